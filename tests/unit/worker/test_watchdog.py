"""`EngineWatchdog`: a command the engine thread does not take within the deadline means wedged."""
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.worker.watchdog import EngineWatchdog

WAIT_S = 10.0


class EngineThreadStandIn:
    """Answers `ping` at once while `is_free` is set; else holds it (or times it out)."""

    def __init__(self) -> None:
        self.is_free = asyncio.Event()
        self.is_free.set()
        self.num_held = 0
        self.times_out = False

    async def ping(self, timeout_s: float) -> None:
        if self.times_out:
            await asyncio.sleep(0)
            raise TimeoutError()
        self.num_held += not self.is_free.is_set()
        await self.is_free.wait()


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


async def until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), WAIT_S)


def test_a_held_command_is_wedged_only_past_the_deadline_and_recovers_when_taken() -> None:
    async def scenario() -> None:
        thread, now = EngineThreadStandIn(), [100.0]
        watchdog = EngineWatchdog(thread, step_timeout_s=5.0, interval_s=0.001, clock=lambda: now[0])
        task = asyncio.create_task(watchdog.run())
        thread.is_free.clear()
        await until(lambda: thread.num_held == 1)
        now[0] = 105.0
        assert watchdog.wedged_reason() is None
        now[0] = 106.5
        assert watchdog.wedged_reason() == ("engine wedged: its thread has not finished a step for 6.5 s "
                                            "(--engine-step-timeout 5 s) while work waits")
        thread.is_free.set()
        await until(lambda: watchdog.wedged_reason() is None)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(scenario())


def test_timed_out_commands_keep_counting_from_the_first_unanswered_one() -> None:
    async def scenario() -> None:
        thread, now = EngineThreadStandIn(), [0.0]
        thread.times_out = True
        watchdog = EngineWatchdog(thread, step_timeout_s=5.0, interval_s=0.001, clock=lambda: now[0])
        task = asyncio.create_task(watchdog.run())
        await asyncio.sleep(0.01)  # many commands time out, all at clock 0
        now[0] = 9.0
        await asyncio.sleep(0.01)
        assert "for 9.0 s" in (watchdog.wedged_reason() or "")
        thread.times_out = False
        await until(lambda: watchdog.wedged_reason() is None)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(scenario())
