"""DNS discovery (`--worker-dns`) on a stub resolver: the router starts before any worker is
behind the name, admits workers appearing behind it through the `--worker` checks, drains out
those leaving (out of rotation and the index at once, forgotten once their streams end), and
keeps its workers when a resolution fails."""
import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.common.stats import WorkerRole
from pdserve.kvcache import Tier, hash_request_blocks
from pdserve.router.routing.cluster import Cluster, ClusterConfig
from pdserve.router.routing.discovery import system_resolver, worker_address
from pdserve.router.routing.registration import DECODE_ROLES
from pdserve.router.routing.worker_pool import PoolConfig
from pdserve.rpc.kv_events import EventBatch, KvSnapshot
from tests.unit.router.routing.cluster_fakes import FakeWorker, info

NAME = "decode.pdserve.svc:7000"
A, B, C = WorkerId("10.0.0.1:7000"), WorkerId("10.0.0.2:7000"), WorkerId("10.0.0.3:7000")
KEYS = hash_request_blocks(list(range(16)), 4)  # 4 blocks every worker holds


class StubResolver:
    """Answers each name with the IPs the test set; `error`: fails instead."""

    def __init__(self, ips: list[str]) -> None:
        self.ips = ips
        self.error: OSError | None = None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        if self.error is not None:
            raise self.error
        return list(self.ips)


class HeldBlocks:
    """A worker's KV events: a snapshot of KEYS, then a stream that stays open."""

    async def subscribe(self) -> AsyncIterator[EventBatch]:
        yield EventBatch("e1", ())
        await asyncio.Event().wait()

    async def snapshot(self) -> KvSnapshot:
        return KvSnapshot("e1", 0, tuple((key, Tier.DEVICE) for key in KEYS))

    async def close(self) -> None:
        pass


def make_cluster(workers: dict[str, FakeWorker], resolver: StubResolver, wait_s: float = 5.0,
                 static: tuple[str, ...] = (), interval_s: float = 3600.0) -> Cluster:
    pool = PoolConfig(poll_interval_s=3600.0, failure_threshold=1, wait_timeout_s=wait_s, drain_timeout_s=5.0)
    config = ClusterConfig(static, pool, dns_names=(NAME,), dns_interval_s=interval_s)
    return Cluster(config, workers.__getitem__, lambda address: HeldBlocks(), resolver)


def fleet(*addresses: WorkerId, model: str = "toy") -> dict[str, FakeWorker]:
    return {a: FakeWorker(a, info(WorkerRole.DECODE, model=model)) for a in addresses}


async def settle(cluster: Cluster, until, timeout_s: float = 5.0) -> None:
    """Let the pool's tasks run until `until()` holds (bounded)."""
    async with asyncio.timeout(timeout_s):
        while not until():
            await asyncio.sleep(0.01)


def up(cluster: Cluster) -> list[WorkerId]:
    return sorted(h.address for h in cluster.pool.up(DECODE_ROLES))


def test_the_router_waits_for_a_first_worker_behind_the_name() -> None:
    resolver = StubResolver([])

    async def scenario() -> list[WorkerId]:
        cluster = make_cluster(fleet(A), resolver)
        starting = asyncio.create_task(cluster.start())
        await settle(cluster, lambda: len(resolver.asked) >= 2)  # resolved to nobody, and asked again
        assert not starting.done()
        resolver.ips = ["10.0.0.1"]
        await starting
        found = up(cluster)
        await cluster.close()
        return found

    assert asyncio.run(scenario()) == [A]
    assert resolver.asked[0] == ("decode.pdserve.svc", 7000)


def test_nobody_behind_the_name_within_the_wait_is_unavailable() -> None:
    async def scenario() -> None:
        cluster = make_cluster({}, StubResolver([]), wait_s=0.0)
        try:
            await cluster.start()
        finally:
            await cluster.close()

    with pytest.raises(WorkerUnavailableError, match="no decode or aggregated worker answered within 0 s"):
        asyncio.run(scenario())


def test_workers_appearing_behind_the_name_are_admitted_and_indexed() -> None:
    resolver = StubResolver(["10.0.0.1"])

    async def scenario() -> tuple[list[WorkerId], int]:
        cluster = make_cluster(fleet(A, B), resolver)
        await cluster.start()
        resolver.ips = ["10.0.0.1", "10.0.0.2"]
        await cluster.discovery.refresh()
        await settle(cluster, lambda: cluster.index.num_blocks(B) == len(KEYS))
        found = up(cluster), cluster.index.num_blocks(A)
        await cluster.close()
        return found

    assert asyncio.run(scenario()) == ([A, B], len(KEYS))


def test_the_router_keeps_resolving_the_name_while_it_serves() -> None:
    resolver = StubResolver(["10.0.0.1"])

    async def scenario() -> None:
        cluster = make_cluster(fleet(A, B), resolver, interval_s=0.05)
        await cluster.start()
        resolver.ips = ["10.0.0.2"]
        await settle(cluster, lambda: up(cluster) == [B] and A not in cluster.pool.handles)
        await cluster.close()

    asyncio.run(scenario())


def test_a_worker_found_with_another_model_is_refused_like_a_static_one() -> None:
    resolver = StubResolver(["10.0.0.1"])
    workers = {**fleet(A), **fleet(B, model="other")}

    async def scenario() -> tuple[list[WorkerId], str | None]:
        cluster = make_cluster(workers, resolver)
        await cluster.start()
        resolver.ips = ["10.0.0.1", "10.0.0.2"]
        await cluster.discovery.refresh()
        await settle(cluster, lambda: cluster.pool.handles[B].refusal is not None)
        found = up(cluster), cluster.pool.handles[B].refusal
        await cluster.close()
        return found

    assert asyncio.run(scenario()) == (
        [A], "worker 10.0.0.2:7000 model_name='other': differs from worker 10.0.0.1:7000's 'toy'")


def test_a_worker_leaving_the_name_is_drained_out_once_its_streams_end() -> None:
    resolver = StubResolver(["10.0.0.1", "10.0.0.2"])

    async def scenario() -> None:
        cluster = make_cluster(fleet(A, B), resolver)
        await cluster.start()
        await settle(cluster, lambda: cluster.index.num_blocks(B) == len(KEYS))
        pool = cluster.pool
        stream = pool.dispatch(pool.handles[B], 0, 1)  # a request streaming from B
        resolver.ips = ["10.0.0.1"]
        await cluster.discovery.refresh()
        assert up(cluster) == [A]  # nothing new goes to B
        assert cluster.index.num_blocks(B) == 0 and cluster.index.num_blocks(A) == len(KEYS)
        await asyncio.sleep(0.5)
        assert B in pool.handles  # its stream still runs on its client
        pool.finish(pool.handles[B], stream)
        await settle(cluster, lambda: B not in pool.handles)
        assert pool.why_out() == ""
        await cluster.close()

    asyncio.run(scenario())


def test_a_drained_worker_back_behind_the_name_is_admitted_again() -> None:
    resolver = StubResolver(["10.0.0.1", "10.0.0.2"])

    async def scenario() -> list[WorkerId]:
        cluster = make_cluster(fleet(A, B), resolver)
        await cluster.start()
        stream = cluster.pool.dispatch(cluster.pool.handles[B], 0, 1)  # keeps B draining
        resolver.ips = ["10.0.0.1"]
        await cluster.discovery.refresh()
        assert cluster.pool.handles[B].down_reason == "draining: its address left the DNS name"
        resolver.ips = ["10.0.0.1", "10.0.0.2"]
        await cluster.discovery.refresh()
        await settle(cluster, lambda: len(up(cluster)) == 2)
        cluster.pool.finish(cluster.pool.handles[B], stream)
        found = up(cluster)
        await cluster.close()
        return found

    assert asyncio.run(scenario()) == [A, B]


def test_a_failed_resolution_keeps_every_worker() -> None:
    resolver = StubResolver(["10.0.0.1", "10.0.0.2"])

    async def scenario() -> list[WorkerId]:
        cluster = make_cluster(fleet(A, B), resolver)
        await cluster.start()
        for error in (socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
                      socket.gaierror(socket.EAI_NONAME, "Name or service not known"), TimeoutError()):
            resolver.error = error
            await cluster.discovery.refresh()
        found = up(cluster)
        await cluster.close()
        return found

    assert asyncio.run(scenario()) == [A, B]


def test_a_static_worker_behind_the_name_too_is_never_drained() -> None:
    resolver = StubResolver(["10.0.0.1", "10.0.0.3"])

    async def scenario() -> list[WorkerId]:
        cluster = make_cluster(fleet(A, C), resolver, static=(C,))
        await cluster.start()
        resolver.ips = ["10.0.0.1"]
        await cluster.discovery.refresh()
        found = up(cluster)
        await cluster.close()
        return found

    assert asyncio.run(scenario()) == [A, C]


def test_the_system_resolver_reads_the_hosts_file_and_brackets_ipv6() -> None:
    assert asyncio.run(system_resolver(5.0)("localhost", 7000)) >= {"127.0.0.1"}
    assert (worker_address("10.1.2.3", 7000), worker_address("fd00::7", 7000)) == ("10.1.2.3:7000", "[fd00::7]:7000")
