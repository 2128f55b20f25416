"""The routed backend: relays the chosen worker's stream with the prefill worker named, routes
again when a worker is lost before answering, keeps dispatched load until the request ends,
and tells each decision once."""
import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.stats import EngineStats, WorkerRole
from pdserve.router.routing.cluster import Cluster, ClusterConfig
from pdserve.router.routing.cost import WorkerLoad
from pdserve.rpc.kv_events_client import KvEventsUnsupported
from pdserve.router.routing.migration import MigrationPolicy
from pdserve.router.routing.planner import Planner, RoutingConfig
from pdserve.router.routing.routed_backend import RoutedBackend, prompt_block_keys
from pdserve.router.routing.worker_pool import PoolConfig
from pdserve.kvcache import hash_request_blocks
from tests.unit.router.routing.cluster_fakes import TPB, FakeWorker, info, stats

PROMPT = tuple(range(300, 318))  # 18 tokens: 5 blocks, 4 full before the last token


class NoEvents:
    async def subscribe(self) -> AsyncIterator:
        raise KvEventsUnsupported("no events in this test")
        yield

    async def snapshot(self):
        raise KvEventsUnsupported("no events in this test")

    async def close(self) -> None:
        pass


def request(rid: str = "r-0", salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(RequestId(rid), PROMPT, SamplingParams(max_tokens=2), cache_salt=salt)


async def routed(workers: dict[str, FakeWorker], policy: str = "round_robin",
                 migration: MigrationPolicy = MigrationPolicy()) -> RoutedBackend:
    config = ClusterConfig(tuple(workers), PoolConfig(poll_interval_s=3600.0, failure_threshold=3, wait_timeout_s=0))
    cluster = Cluster(config, workers.__getitem__, lambda address: NoEvents())
    model = await cluster.start()
    planner = Planner(cluster.pool, cluster.index, RoutingConfig(policy=policy), TPB)
    return RoutedBackend(cluster, planner, model, migration=migration)


async def texts(backend: RoutedBackend, req: GenerationRequest) -> list[str]:
    return [out.text async for out in backend.generate(req)]


def test_block_keys_are_the_workers_own_salt_included() -> None:
    assert prompt_block_keys(request(salt="t1"), TPB) == hash_request_blocks(PROMPT[:16], TPB, cache_salt="t1")
    assert prompt_block_keys(request(), TPB) != prompt_block_keys(request(salt="t1"), TPB)


@pytest.mark.parametrize("prefill_id", ["prefill-0/pod-a", None])  # None: a worker that gives no id
def test_the_decode_worker_is_told_its_prefill_worker_and_the_id_it_gave(prefill_id: str | None) -> None:
    workers = {"p:1": FakeWorker("p:1", info(WorkerRole.PREFILL), worker_id=prefill_id),
               "d:2": FakeWorker("d:2", info(WorkerRole.DECODE))}

    async def scenario() -> None:
        backend = await routed(workers)
        assert await texts(backend, request()) == ["t0", "t1"]
        assert backend.describe_route(RequestId("r-0")) == (
            "decode=d:2;decode_overlap=0;prefill=p:1;prefill_overlap=0;prompt_blocks=5;prefilled_by=p:1")
        assert backend.describe_route(RequestId("r-0")) is None  # told once
        await backend.close()

    asyncio.run(scenario())
    assert (workers["d:2"].generated, workers["p:1"].generated) == ([("r-0", "p:1")], [])
    assert workers["d:2"].prefill_worker_ids == [prefill_id]
    assert workers["d:2"].block_keys == [tuple(prompt_block_keys(request(), TPB))]  # hashed here, sent on


def test_the_route_reports_the_path_that_ran_when_the_decode_worker_prefilled_itself() -> None:
    workers = {"p:1": FakeWorker("p:1", info(WorkerRole.PREFILL)), "d:2": FakeWorker("d:2", info(WorkerRole.DECODE))}
    workers["d:2"].prefills_locally = True  # e.g. the prompt was in its own cache

    async def scenario() -> RoutedBackend:
        backend = await routed(workers)
        assert await texts(backend, request()) == ["t0", "t1"]
        return backend

    backend = asyncio.run(scenario())
    assert backend.describe_route(RequestId("r-0")).endswith(";prefill=p:1;prefill_overlap=0;prompt_blocks=5;"
                                                             "prefilled_by=local")
    assert backend._cluster.counters.num_local_prefills_instead == 1


def test_a_deep_prefill_queue_has_the_decode_worker_prefill_and_is_counted() -> None:
    workers = {"p:1": FakeWorker("p:1", info(WorkerRole.PREFILL), stats(waiting=4, queued=4096)),
               "d:2": FakeWorker("d:2", info(WorkerRole.DECODE))}

    async def scenario() -> RoutedBackend:
        backend = await routed(workers)
        assert await texts(backend, request()) == ["t0", "t1"]
        return backend

    backend = asyncio.run(scenario())
    assert workers["d:2"].generated == [("r-0", None)]
    assert backend.describe_route(RequestId("r-0")) == ("decode=d:2;decode_overlap=0;prefill=local_for_queue;"
                                                        "prompt_blocks=5")
    counters = backend._cluster.counters
    assert (counters.num_local_prefills_for_queue, counters.num_local_prefills_instead) == (1, 0)


def test_a_worker_lost_before_answering_is_dropped_and_the_request_routed_again() -> None:
    workers = {a: FakeWorker(a, info()) for a in ("a:1", "b:2")}

    async def scenario() -> RoutedBackend:
        backend = await routed(workers)  # round robin: a:1 first
        workers["a:1"].is_down = True  # died after its last stats report
        assert await texts(backend, request()) == ["t0", "t1"]
        return backend

    backend = asyncio.run(scenario())
    assert workers["b:2"].generated == [("r-0", None)]
    assert [h.address for h in backend._pool.up({WorkerRole.BOTH})] == ["b:2"]
    assert backend._cluster.counters.retries == {"a:1": 1}
    assert backend.describe_route(RequestId("r-0")) == "decode=b:2;decode_overlap=0;prompt_blocks=5"


def test_a_stream_that_breaks_after_answering_fails_the_request_without_migration() -> None:
    workers = {a: FakeWorker(a, info()) for a in ("a:1", "b:2")}
    workers["a:1"].fail_generate_after = 1

    async def scenario() -> None:
        backend = await routed(workers, migration=MigrationPolicy(limit=0))
        outputs = []
        with pytest.raises(WorkerUnavailableError, match="stream broke"):
            async for out in backend.generate(request()):
                outputs.append(out.text)
        assert outputs == ["t0"]

    asyncio.run(scenario())
    assert workers["b:2"].generated == []


def test_every_worker_lost_is_unavailable() -> None:
    workers = {a: FakeWorker(a, info()) for a in ("a:1", "b:2")}

    async def scenario() -> None:
        backend = await routed(workers)
        for worker in workers.values():
            worker.is_down = True
        with pytest.raises(WorkerUnavailableError, match="worker b:2 unavailable: connection refused"):
            await texts(backend, request())
        assert backend._pool.up({WorkerRole.BOTH}) == []
        with pytest.raises(WorkerUnavailableError) as caught:
            await backend.stats()
        assert caught.value.reason == (
            "no decode or aggregated worker is up ("
            "a:1: a request failed and so did a stats query: worker a:1 unavailable: connection refused; "
            "b:2: a request failed and so did a stats query: worker b:2 unavailable: connection refused)")
        with pytest.raises(WorkerUnavailableError, match="no decode or aggregated worker is up"):
            await texts(backend, request("r-1"))

    asyncio.run(scenario())


def test_dispatched_load_counts_until_the_request_ends_its_prefill_part_until_the_first_output() -> None:
    workers = {"p:1": FakeWorker("p:1", info(WorkerRole.PREFILL)), "d:2": FakeWorker("d:2", info(WorkerRole.DECODE))}

    async def scenario() -> None:
        backend = await routed(workers)
        pool = backend._pool
        stream = backend.generate(request())
        loads = []
        async for _ in stream:
            loads.append((pool.load(pool.handles[WorkerId("p:1")]), pool.load(pool.handles[WorkerId("d:2")])))
        loads.append((pool.load(pool.handles[WorkerId("p:1")]), pool.load(pool.handles[WorkerId("d:2")])))
        assert loads == [(WorkerLoad(0, 0, 0), WorkerLoad(1, 5, 0))] * 2 + [(WorkerLoad(0, 0, 0), WorkerLoad(0, 0, 0))]

    asyncio.run(scenario())


def test_a_prompts_keys_count_on_its_workers_overlaps_as_long_as_its_load() -> None:
    """While its stream runs, the prompt's 4 full blocks count as held by the decode worker,
    and by the prefill worker until the first output: the next prompt sharing that prefix
    sees it there before any event says so."""
    p, d = WorkerId("p:1"), WorkerId("d:2")
    seen: list[dict[WorkerId, int]] = []
    index = []  # the backend's prefix index, once it exists

    def held() -> dict[WorkerId, int]:
        keys = prompt_block_keys(request(), TPB)
        return {w: o.num_device for w, o in index[0].overlaps(keys, [p, d]).items()}

    class Watched(FakeWorker):
        async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                           prefill_worker_id: WorkerId | None = None):
            seen.append(held())  # dispatched, nothing answered yet
            async for output in super().generate(request, prefill_worker, prefill_worker_id):
                yield output

    workers = {"p:1": FakeWorker("p:1", info(WorkerRole.PREFILL)), "d:2": Watched("d:2", info(WorkerRole.DECODE))}

    async def scenario() -> None:
        backend = await routed(workers)
        index.append(backend._cluster.index)
        async for _ in backend.generate(request()):
            seen.append(held())
        seen.append(held())
        assert seen == [{p: 4, d: 4}] + [{p: 0, d: 4}] * 2 + [{p: 0, d: 0}]

    asyncio.run(scenario())


def test_stats_sum_the_workers_in_rotation() -> None:
    workers = {"a:1": FakeWorker("a:1", info(), stats(running=1, used=5)),
               "b:2": FakeWorker("b:2", info(), stats(waiting=2, used=7, queued=30))}

    async def scenario() -> EngineStats:
        return await (await routed(workers)).stats()

    assert asyncio.run(scenario()) == EngineStats(1, 2, 188, 200, 12, 30, 0, 0, 0)


def test_when_every_worker_failed_the_request_the_last_failure_is_raised() -> None:
    workers = {a: FakeWorker(a, info()) for a in ("a:1", "b:2")}

    async def scenario() -> None:
        backend = await routed(workers)
        for worker in workers.values():
            worker.fail_generate_after = 0  # answers stats, fails every stream (overloaded)
        with pytest.raises(WorkerUnavailableError, match="worker b:2 unavailable: stream broke"):
            await texts(backend, request())
        assert [h.address for h in backend._pool.up({WorkerRole.BOTH})] == ["a:1", "b:2"]  # still alive

    asyncio.run(scenario())
