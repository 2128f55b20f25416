"""`DrainGate` and `serve_until_stopped`'s drain: running requests finish, new ones are refused
saying why, health says NOT_SERVING, over a fake engine (the gate alone, then over loopback gRPC)."""
import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest
from fake_engine import STATS, FakeEngine, expected_outputs, make_request

from pdserve.common.errors import WorkerDrainingError, WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.rpc.worker_client import GrpcBackend
from pdserve.worker.drain import DrainGate
from pdserve.worker.server import serve_until_stopped

WAIT_S = 10.0


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


def test_a_closed_gate_refuses_new_requests_and_stats_while_the_running_one_finishes() -> None:
    async def scenario() -> None:
        gate = DrainGate(FakeEngine())
        running = gate.generate(make_request("running"))
        first = await anext(running)
        gate.close("draining: test")
        with pytest.raises(WorkerDrainingError, match="^draining: test$"):
            await anext(gate.generate(make_request("late")))
        with pytest.raises(WorkerDrainingError):
            gate.stats()
        assert (gate.num_running, await gate.wait_idle(0.05)) == (1, False)
        assert [first, *[output async for output in running]] == expected_outputs(make_request("running"))
        assert (gate.num_running, await gate.wait_idle(0.05)) == (0, True)

    run(scenario())


def test_an_open_gate_is_the_engine() -> None:
    async def scenario() -> None:
        gate = DrainGate(FakeEngine())
        assert [o async for o in gate.generate(make_request("a"))] == expected_outputs(make_request("a"))
        assert (gate.stats(), await gate.wait_idle(0)) == (STATS, True)

    run(scenario())


class HeldEngine(FakeEngine):
    """Yields a request's first output, then the rest once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        for i, output in enumerate(expected_outputs(request)):
            if i == 1:
                await self.release.wait()
            yield output


def test_a_stopped_server_drains_a_running_stream_and_refuses_a_new_one_over_grpc(unused_port: int) -> None:
    async def scenario() -> None:
        stop = asyncio.Event()
        engine = HeldEngine()
        serving = asyncio.create_task(serve_until_stopped(engine, "127.0.0.1", unused_port, stop, 30.0))
        client = GrpcBackend(f"127.0.0.1:{unused_port}")
        try:
            await wait_serving(client)
            running = client.generate(make_request("running"))
            first = await anext(running)
            stop.set()
            await wait_serving(client, False)  # the gate closes at the server task's next turn
            with pytest.raises(WorkerUnavailableError, match="unavailable: draining: shutting down, finishing "
                                                             "running requests within 30 s"):
                await anext(client.generate(make_request("late")))
            engine.release.set()
            rest = [output async for output in running]
            assert [first, *rest] == expected_outputs(make_request("running"))
            await asyncio.wait_for(serving, WAIT_S)  # idle: the server stops without waiting out the grace
        finally:
            stop.set()
            await client.close()
            await asyncio.gather(serving, return_exceptions=True)

    run(scenario())


async def wait_serving(client: GrpcBackend, is_serving: bool = True) -> None:
    for _ in range(100):
        try:
            if await client.is_serving() == is_serving:
                return
        except WorkerUnavailableError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"the test server never answered health {'SERVING' if is_serving else 'NOT_SERVING'}")


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
