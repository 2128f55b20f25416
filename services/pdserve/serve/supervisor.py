"""Child processes started in order (a group at a time), each waited on until ready, watched,
restarted with backoff where their spec says so, and all stopped on the way out.

Contract: once `stop_all()` returns, no child is alive. Children stop group by group, in start
order: every child of a group is sent the stop signal at once, the group is given
`shutdown_timeout_s`, then what is left of it is killed. So the workers (the first group) drain
while the router (the next) still relays their streams and refuses new requests saying why, and
the router stops once nothing is left to relay. Children run in their own sessions, so a
terminal's Ctrl-C reaches only the supervisor, which forwards it in that order.

Restarts: a child with a `RestartPolicy` that exits while watched (killed, crashed, or drained
after its own SIGTERM) is started again with the same command line after a backoff that doubles
with each death in a row; one that stays up `reset_after_s` starts a new series. A restarted
child not ready within `startup_timeout_s` is killed, which counts as one more death. A child
without a policy that exits ends `watch()`, and so does one that died `max_deaths_in_a_row`
times in a row (a worker that cannot start is not restarted for ever).
"""
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn, Protocol

from pdserve.common.errors import PdserveError

KILL_WAIT_S = 5.0  # a SIGKILLed process is reaped well within this
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ChildFailedError(PdserveError):
    """A child exited, or was not ready in time; the message is one line for the user."""


class StopRequested(PdserveError):
    """The supervisor received a stop signal (Ctrl-C, SIGTERM, a closed terminal)."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Death n of a series (n >= 1) waits `initial_backoff_s` * 2**(n-1), at most `max_backoff_s`."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0  # up this long since its (re)start: its next death starts a new series
    max_deaths_in_a_row: int | None = None  # this many deaths in a row end `watch()`; None: no bound

    def backoff_s(self, num_deaths_in_a_row: int) -> float:
        return min(self.initial_backoff_s * 2.0 ** (num_deaths_in_a_row - 1), self.max_backoff_s)


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    is_ready: Callable[[], bool]  # a probe that answers within a second or so
    env: Mapping[str, str] | None = None  # None: inherit this process's environment
    restart: RestartPolicy | None = None  # None: its exit ends `watch()`


class RestartListener(Protocol):
    """Told of every restart (serve logs them and counts them in a metric)."""

    def child_died(self, name: str, exit_code: int, backoff_s: float, num_deaths_in_a_row: int) -> None: ...

    def child_restarted(self, name: str, pid: int) -> None: ...

    def child_ready(self, name: str) -> None: ...


@dataclass(slots=True, eq=False)
class _Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes]
    started_at: float
    is_ready: bool = False
    num_deaths_in_a_row: int = 0
    restart_at: float | None = None  # set while dead and waiting out its backoff


class Supervisor:
    """Starts children group by group and watches them until a signal or a fatal exit."""

    def __init__(self, startup_timeout_s: float, shutdown_timeout_s: float,
                 poll_interval_s: float = 0.1, listener: RestartListener | None = None) -> None:
        self._startup_timeout_s = startup_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._poll_interval_s = poll_interval_s
        self._listener = listener
        self._groups: list[list[_Child]] = []
        self._stop_signal: signal.Signals | None = None

    def install_signal_handlers(self) -> None:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self.request_stop)

    def request_stop(self, signum: int, _: FrameType | None = None) -> None:
        """Stop as on signal `signum`: `watch` and `start_group` raise StopRequested at their next turn."""
        self._stop_signal = signal.Signals(signum)

    def start(self, spec: ChildSpec) -> int:
        """Start `spec` and return its pid once it is ready; as `start_group`."""
        return self.start_group([spec])[0]

    def start_group(self, specs: Sequence[ChildSpec]) -> list[int]:
        """Start every child of `specs` at once; return their pids once each `is_ready()`.
        The group shares one startup timeout. Raises ChildFailedError naming a child that exits
        or is not ready in time, StopRequested on a stop signal; either way the children
        started stay tracked, for `stop_all()`."""
        started = [_Child(spec, _spawn(spec), time.monotonic()) for spec in specs]
        self._groups.append(started)
        deadline = time.monotonic() + self._startup_timeout_s
        while pending := [child for child in started if not child.spec.is_ready()]:
            self._check_stop_signal()
            for child in pending:
                if child.process.poll() is not None:
                    raise ChildFailedError(f"{child.spec.name} exited with code {child.process.returncode} "
                                           "while starting")
            if time.monotonic() > deadline:
                raise ChildFailedError(f"{pending[0].spec.name} was not ready within {self._startup_timeout_s:g} s")
            time.sleep(self._poll_interval_s)
        for child in started:
            child.is_ready = True
        return [child.process.pid for child in started]

    def watch(self) -> NoReturn:
        """Block until a stop signal (raises StopRequested) or until a child without a restart
        policy exits (raises ChildFailedError naming it); restart the others as they die."""
        while True:
            self._check_stop_signal()
            for child in [child for group in self._groups for child in group]:
                self._tend(child, time.monotonic())
            time.sleep(self._poll_interval_s)

    def _tend(self, child: _Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._restart(child, now)
            return
        exit_code = child.process.poll()
        if exit_code is None:
            if not child.is_ready:
                self._check_restarted(child, now)
            return
        policy = child.spec.restart
        if policy is None:
            raise ChildFailedError(f"{child.spec.name} exited unexpectedly with code {exit_code}")
        if child.is_ready and now - child.started_at >= policy.reset_after_s:
            child.num_deaths_in_a_row = 0
        child.num_deaths_in_a_row += 1
        if policy.max_deaths_in_a_row is not None and child.num_deaths_in_a_row >= policy.max_deaths_in_a_row:
            raise ChildFailedError(f"{child.spec.name} exited {child.num_deaths_in_a_row} times in a row (last with code "
                                   f"{exit_code}); not restarting it again: its log above says why")
        backoff_s = policy.backoff_s(child.num_deaths_in_a_row)
        child.restart_at = now + backoff_s
        if self._listener is not None:
            self._listener.child_died(child.spec.name, exit_code, backoff_s, child.num_deaths_in_a_row)

    def _restart(self, child: _Child, now: float) -> None:
        child.process, child.started_at, child.is_ready, child.restart_at = _spawn(child.spec), now, False, None
        if self._listener is not None:
            self._listener.child_restarted(child.spec.name, child.process.pid)

    def _check_restarted(self, child: _Child, now: float) -> None:
        """A restarted child becomes ready, or is killed once past the startup timeout."""
        if child.spec.is_ready():
            child.is_ready = True
            if self._listener is not None:
                self._listener.child_ready(child.spec.name)
        elif now - child.started_at > self._startup_timeout_s:
            child.process.kill()  # its death is seen, and backed off, on the next turn

    def _check_stop_signal(self) -> None:
        if self._stop_signal is not None:
            raise StopRequested(f"received {self._stop_signal.name}")

    def stop_all(self) -> dict[str, int]:
        """Stop every child (see the module's contract); returns each child's exit code, in stop order."""
        sig = signal.SIGINT if self._stop_signal == signal.SIGINT else signal.SIGTERM
        codes = {}
        for group in self._groups:
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(sig)
            deadline = time.monotonic() + self._shutdown_timeout_s
            for child in group:
                codes[child.spec.name] = _wait_or_kill(child.process, deadline)
        return codes


def _wait_or_kill(process: subprocess.Popen[bytes], deadline: float) -> int:
    try:
        return process.wait(max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        process.kill()
    return process.wait(KILL_WAIT_S)


def _spawn(spec: ChildSpec) -> subprocess.Popen[bytes]:
    return subprocess.Popen(spec.argv, env=spec.env, start_new_session=True)
