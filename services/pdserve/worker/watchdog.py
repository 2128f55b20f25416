"""`EngineWatchdog`: tells a wedged engine thread from a busy one, from the event loop.

A no-op command is sent through the engine thread's inbox every `interval_s`; the thread takes
it between two steps. While one has waited longer than `step_timeout_s`, the thread is stuck in
a step (or a call) with work queued behind it: the engine is wedged. It recovers by itself once
the thread takes the command, so the worker reports serving again without a restart.
"""
import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class EngineThread(Protocol):
    """What the watchdog needs of `ThreadedEngine`: a no-op command, answered between steps."""

    async def ping(self, timeout_s: float) -> None: ...


class EngineWatchdog:
    """Run `run()` as a task on the worker's event loop; ask `wedged_reason()` at any time."""

    def __init__(self, engine: EngineThread, step_timeout_s: float, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._step_timeout_s = step_timeout_s
        self._interval_s = interval_s if interval_s is not None else min(1.0, step_timeout_s / 4)
        self._clock = clock
        self._waiting_since: float | None = None  # when the oldest unanswered command was sent

    async def run(self) -> None:
        """Ping the engine thread until cancelled."""
        while True:
            if self._waiting_since is None:
                self._waiting_since = self._clock()
            try:
                await self._engine.ping(self._step_timeout_s)
            except TimeoutError:
                log.warning("%s", self.wedged_reason() or "engine wedged")
                continue  # still stuck: ask again, counting from the first unanswered command
            if (reason := self.wedged_reason()) is not None:
                log.warning("engine moving again; it was %s", reason.removeprefix("engine "))
            self._waiting_since = None
            await asyncio.sleep(self._interval_s)

    def wedged_reason(self) -> str | None:
        """None while the engine thread answers within `step_timeout_s`; else why it is wedged."""
        if self._waiting_since is None:
            return None
        waited_s = self._clock() - self._waiting_since
        if waited_s <= self._step_timeout_s:
            return None
        return (f"engine wedged: its thread has not finished a step for {waited_s:.1f} s "
                f"(--engine-step-timeout {self._step_timeout_s:g} s) while work waits")
