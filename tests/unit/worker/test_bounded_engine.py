"""`BoundedEngine`: a bound on waiting requests and the wedge verdict, over a fake engine."""
import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from fake_engine import STATS, FakeEngine, expected_outputs, make_request

from pdserve.common.errors import EngineWedgedError, OverloadedError
from pdserve.worker.admission import BoundedEngine

WAIT_S = 10.0


class Wedge:
    def __init__(self) -> None:
        self.reason: str | None = None

    def wedged_reason(self) -> str | None:
        return self.reason


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


async def drain(engine: BoundedEngine, request_id: str) -> list:
    return [output async for output in engine.generate(make_request(request_id))]


def test_past_the_bound_a_request_is_refused_at_once_and_a_slot_frees_on_first_output_or_abort() -> None:
    async def scenario() -> None:
        fake = FakeEngine(hang_after=0)  # admitted, never a first output
        engine = BoundedEngine(fake, max_waiting=1, wedge=Wedge())
        waiting = asyncio.create_task(drain(engine, "first"))
        await asyncio.wait_for(fake.hanging.wait(), WAIT_S)
        with pytest.raises(OverloadedError, match="1 requests are waiting .*--max-waiting-requests 1"):
            await drain(engine, "second")
        assert (engine.num_waiting, len(fake.prefill_workers)) == (1, 1)  # the refused one never reached it
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert engine.num_waiting == 0
        fake.hang_after = None
        assert await drain(engine, "third") == expected_outputs(make_request("third"))
        assert engine.num_waiting == 0

    run(scenario())


def test_a_streaming_request_stops_counting_as_waiting_at_its_first_output() -> None:
    async def scenario() -> None:
        fake = FakeEngine(hang_after=1)  # one output, then it keeps running
        engine = BoundedEngine(fake, max_waiting=1, wedge=Wedge())
        running = asyncio.create_task(drain(engine, "running"))
        await asyncio.wait_for(fake.hanging.wait(), WAIT_S)
        assert engine.num_waiting == 0
        fake.hang_after = None
        assert await drain(engine, "next") == expected_outputs(make_request("next"))
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    run(scenario())


def test_a_wedged_engine_refuses_requests_and_its_stats_name_why_until_it_recovers() -> None:
    async def scenario() -> None:
        fake = FakeEngine()
        wedge = Wedge()
        engine = BoundedEngine(fake, max_waiting=4, wedge=wedge)
        wedge.reason = "engine wedged: no step for 61 s"
        with pytest.raises(EngineWedgedError, match="no step for 61 s"):
            engine.stats()
        with pytest.raises(EngineWedgedError):
            await drain(engine, "refused")
        assert (fake.prefill_workers, engine.num_waiting) == ([], 0)
        wedge.reason = None
        assert engine.stats() == STATS
        assert await drain(engine, "served") == expected_outputs(make_request("served"))

    run(scenario())
