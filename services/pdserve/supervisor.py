"""Child processes started in order, each waited on until ready, all stopped on the way out.

Contract: once `stop_all()` returns, no child is alive. Each child is first sent the stop
signal, then given `shutdown_timeout_s`, then killed; children stop in reverse start order
(the router before the worker it calls). Children run in their own sessions, so a terminal's
Ctrl-C reaches only the supervisor, which forwards it in that order.
"""
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
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
        """Start `spec` and return its pid once `spec.is_ready()`. Raises ChildFailedError if
        it exits or is not ready within the startup timeout, StopRequested on a stop signal."""
        process = subprocess.Popen(spec.argv, env=spec.env, start_new_session=True)
        self._children.append((spec, process))
        deadline = time.monotonic() + self._startup_timeout_s
        while not spec.is_ready():
            self._check_stop_signal()
            if process.poll() is not None:
                raise ChildFailedError(f"{spec.name} exited with code {process.returncode} while starting")
            if time.monotonic() > deadline:
                raise ChildFailedError(f"{spec.name} was not ready within {self._startup_timeout_s:g} s")
            time.sleep(self._poll_interval_s)
        return process.pid

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
