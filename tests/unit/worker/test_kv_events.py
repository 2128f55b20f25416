"""The worker's KvEvents service over loopback gRPC, on a real engine (token-store model):
the first batch, events as the KV cache manager numbers them, snapshots, overflow, stopping;
and the router's subscriber keeping its prefix index in step with it."""
import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.kvcache import BlockStored, Tier, hash_request_blocks
from pdserve.rpc.kv_events_client import KvEventsClient
from pdserve.router.routing.kv_subscriber import KvEventSubscriber
from pdserve.router.routing.prefix_index import Overlap, PrefixIndex
from pdserve.router.routing.routing_metrics import RoutingCounters
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.kv.events import KvEventPublisher
from pdserve.worker.server import WorkerServer
from pdserve.rpc.kv_events_service import SubscriberOverflow, add_kv_events_service
from tests.unit.engine.test_llm_engine import make_engine, request

TPB = 4
INFO = ModelInfo("toy", 128, TPB, "sha256-v1", WorkerRole.BOTH, 97, (0,))
PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks
WORKER = WorkerId("w")


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


@pytest.fixture
def threaded():
    engine = ThreadedEngine(make_engine(tpb=TPB), INFO, idle_wait_s=0.005)
    engine.start()
    yield engine
    engine.stop()


@asynccontextmanager
async def serving(engine: ThreadedEngine, max_queued: int = 1024) -> AsyncIterator[tuple[KvEventsClient, asyncio.Event]]:
    """The engine's worker server with KvEvents; yields a router-side client and the stop event."""
    stopping = asyncio.Event()
    publisher = KvEventPublisher(engine, max_queued)
    server = WorkerServer(engine, "127.0.0.1", 0, [lambda s: add_kv_events_service(s, publisher, stopping)])
    client = KvEventsClient(f"127.0.0.1:{await server.start()}", rpc_timeout_s=5.0)
    try:
        yield client, stopping
    finally:
        await client.close()
        await server.stop(0)


async def generate(engine: ThreadedEngine, rid: str, prompt: list[int], max_tokens: int = 2) -> None:
    async for _ in engine.generate(request(rid, prompt, max_tokens=max_tokens, ignore_eos=True)):
        pass


async def until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def test_stream_starts_empty_then_carries_the_managers_events_in_order(threaded) -> None:
    async def scenario() -> None:
        async with serving(threaded) as (client, _):
            batches = client.subscribe()
            first = await anext(batches)
            assert first.events == ()
            await generate(threaded, "r1", PROMPT)
            events = []
            while len(events) < 5:
                events += (await anext(batches)).events
            await batches.aclose()
        assert all(isinstance(e, BlockStored) and e.tier is Tier.DEVICE for e in events)
        assert [e.seq for e in events] == [0, 1, 2, 3, 4]
        assert [h for e in events for h in e.block_hashes] == hash_request_blocks(PROMPT[:20], TPB)
        assert {e.epoch for e in [first]} == {first.epoch} and len(first.epoch) == 32

    run(scenario())


def test_snapshot_holds_every_cached_block_and_the_next_seq(threaded) -> None:
    async def scenario() -> None:
        async with serving(threaded) as (client, _):
            await generate(threaded, "r1", PROMPT)
            await generate(threaded, "r2", PROMPT[:9])  # 2 more full blocks, both already cached
            snapshot = await client.snapshot()
        assert snapshot.next_seq == 5
        assert sorted(snapshot.blocks) == sorted((h, Tier.DEVICE) for h in hash_request_blocks(PROMPT[:20], TPB))

    run(scenario())


def test_a_subscriber_that_falls_behind_is_dropped_and_told_to_resync(threaded) -> None:
    async def scenario() -> None:
        publisher = KvEventPublisher(threaded, max_queued_batches=1)
        batches = publisher.subscribe(asyncio.Event())
        await anext(batches)
        await generate(threaded, "r1", PROMPT[:9])  # nobody reads: its batches pile up
        await generate(threaded, "r2", [1] + PROMPT[:12])
        with pytest.raises(SubscriberOverflow, match="subscriber fell 1 event batches behind"):
            await anext(batches)

    run(scenario())


def test_streams_end_unavailable_once_the_worker_is_stopping(threaded) -> None:
    async def scenario() -> None:
        async with serving(threaded) as (client, stopping):
            batches = client.subscribe()
            await anext(batches)
            stopping.set()
            with pytest.raises(WorkerUnavailableError, match="the worker is stopping"):
                await anext(batches)

    run(scenario())


def test_the_routers_index_follows_the_worker_from_snapshot_and_events(threaded) -> None:
    async def scenario() -> None:
        async with serving(threaded) as (client, _):
            await generate(threaded, "before", PROMPT[:9])  # in the snapshot, not the stream
            index, counters = PrefixIndex(), RoutingCounters()
            subscriber = KvEventSubscriber(WORKER, client, index, counters, lambda w, r: None, 5.0)
            task = asyncio.create_task(subscriber.run())
            await until(lambda: index.is_synced(WORKER))
            await generate(threaded, "after", PROMPT)
            keys = hash_request_blocks(PROMPT, TPB)
            await until(lambda: index.overlaps(keys, [WORKER])[WORKER].num_blocks == 5)
            assert index.overlaps(keys, [WORKER]) == {WORKER: Overlap(num_device=5)}
            assert counters.resyncs == {(WORKER, "subscribe"): 1}
            task.cancel()

    run(scenario())
