"""Child processes started in order (a group at a time), each waited on until ready, all stopped
on the way out.

Contract: once `stop_all()` returns, no child is alive. Each child is first sent the stop
signal, then given `shutdown_timeout_s`, then killed; children stop in reverse start order
(the router before the workers it calls). Children run in their own sessions, so a terminal's
Ctrl-C reaches only the supervisor, which forwards it in that order.
"""
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

from pdserve.common.errors import PdserveError

KILL_WAIT_S = 5.0  # a SIGKILLed process is reaped well within this
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ChildFailedError(PdserveError):
    """A child exited, or was not ready in time; the message is one line for the user."""


class StopRequested(PdserveError):
    """The supervisor received a stop signal (Ctrl-C, SIGTERM, a closed terminal)."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    is_ready: Callable[[], bool]  # a probe that answers within a second or so
    env: Mapping[str, str] | None = None  # None: inherit this process's environment


class Supervisor:
    """Starts children one by one and watches them until a signal or a child's exit."""

    def __init__(self, startup_timeout_s: float, shutdown_timeout_s: float,
                 poll_interval_s: float = 0.1) -> None:
        self._startup_timeout_s = startup_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._poll_interval_s = poll_interval_s
        self._children: list[tuple[ChildSpec, subprocess.Popen[bytes]]] = []
        self._stop_signal: signal.Signals | None = None

    def install_signal_handlers(self) -> None:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        self._stop_signal = signal.Signals(signum)

    def start(self, spec: ChildSpec) -> int:
        """Start `spec` and return its pid once it is ready; as `start_group`."""
        return self.start_group([spec])[0]

    def start_group(self, specs: Sequence[ChildSpec]) -> list[int]:
        """Start every child of `specs` at once; return their pids once each `is_ready()`.
        The group shares one startup timeout. Raises ChildFailedError naming a child that exits
        or is not ready in time, StopRequested on a stop signal; either way the children
        started stay tracked, for `stop_all()`."""
        started = []
        for spec in specs:
            started.append((spec, subprocess.Popen(spec.argv, env=spec.env, start_new_session=True)))
            self._children.append(started[-1])
        deadline = time.monotonic() + self._startup_timeout_s
        pending = list(started)
        while pending := [(spec, process) for spec, process in pending if not spec.is_ready()]:
            self._check_stop_signal()
            for spec, process in pending:
                if process.poll() is not None:
                    raise ChildFailedError(f"{spec.name} exited with code {process.returncode} while starting")
            if time.monotonic() > deadline:
                raise ChildFailedError(f"{pending[0][0].name} was not ready within {self._startup_timeout_s:g} s")
            time.sleep(self._poll_interval_s)
        return [process.pid for _, process in started]

    def watch(self) -> NoReturn:
        """Block until a stop signal (raises StopRequested) or until a child exits (raises
        ChildFailedError naming it)."""
        while True:
            self._check_stop_signal()
            for spec, process in self._children:
                if process.poll() is not None:
                    raise ChildFailedError(f"{spec.name} exited unexpectedly with code {process.returncode}")
            time.sleep(self._poll_interval_s)

    def _check_stop_signal(self) -> None:
        if self._stop_signal is not None:
            raise StopRequested(f"received {self._stop_signal.name}")

    def stop_all(self) -> dict[str, int]:
        """Stop every child (see the module's contract); returns each child's exit code."""
        sig = signal.SIGINT if self._stop_signal == signal.SIGINT else signal.SIGTERM
        codes = {}
        for spec, process in reversed(self._children):
            codes[spec.name] = self._stop(process, sig)
        return codes

    def _stop(self, process: subprocess.Popen[bytes], sig: signal.Signals) -> int:
        if process.poll() is None:
            process.send_signal(sig)
            try:
                return process.wait(self._shutdown_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.wait(KILL_WAIT_S)
