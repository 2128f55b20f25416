"""The router's view of its workers: the pool (registration, health, load), the prefix index,
one KV event subscriber per worker in rotation, and DNS discovery of workers, wired together.

A worker coming up gets a subscriber (which syncs its index part from a snapshot) and, once
the cluster has started, the LoRA adapters loaded since it started (`lora_catalog.py`); a worker
going down (or drained out by discovery) loses its subscriber and its index entries. A
subscriber whose stream breaks with UNAVAILABLE takes its worker out of rotation.
"""
import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.ids import WorkerId
from pdserve.common.stats import ModelInfo
from pdserve.common.tls import TlsConfig
from pdserve.kvcache import HASH_ALGORITHM
from pdserve.rpc.worker_client import GrpcBackend
from pdserve.rpc.kv_events_client import KvEventsClient
from pdserve.router.routing.discovery import DnsDiscovery, Resolve, system_resolver
from pdserve.router.routing.kv_subscriber import EventSource, KvEventSubscriber
from pdserve.router.routing.lora_catalog import LoraCatalog
from pdserve.router.routing.prefix_index import PrefixIndex
from pdserve.router.routing.registration import cluster_info
from pdserve.router.routing.routing_metrics import RoutingCollector, RoutingCounters
from pdserve.router.routing.worker_pool import PoolConfig, WorkerClient, WorkerHandle, WorkerPool

_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    addresses: tuple[str, ...]
    pool: PoolConfig = PoolConfig()
    rpc_timeout_s: float = 5.0
    generate_timeout_s: float = 3600.0
    tls: TlsConfig | None = None  # our credentials on the internal plane; None: plain text
    dns_names: tuple[str, ...] = ()  # "name:port" resolved to more workers (discovery.py)
    dns_interval_s: float = 5.0


class Cluster:
    """`connect` and `events` build each worker's control and event clients (gRPC by default);
    `resolve` looks up the DNS names (the system resolver by default)."""

    def __init__(self, config: ClusterConfig, connect: Callable[[str], WorkerClient] | None = None,
                 events: Callable[[str], EventSource] | None = None, resolve: Resolve | None = None) -> None:
        self._config = config
        self.index = PrefixIndex()
        self.counters = RoutingCounters()
        self.pool = WorkerPool(config.addresses, connect or self._connect, config.pool, HASH_ALGORITHM)
        self.pool.listener = self
        self._make_events = events or (lambda address: KvEventsClient(address, config.rpc_timeout_s, tls=config.tls))
        self._event_sources: dict[WorkerId, EventSource] = {}
        self._subscribers: dict[WorkerId, asyncio.Task] = {}
        self.discovery = DnsDiscovery(config.dns_names, self.pool, resolve or system_resolver(config.rpc_timeout_s),
                                      config.dns_interval_s, static=config.addresses) if config.dns_names else None
        self._discovering: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # event clients of drained workers, closing
        self.loras: LoraCatalog | None = None  # once started
        self._syncs: set[asyncio.Task] = set()

    def _connect(self, address: str) -> GrpcBackend:
        return GrpcBackend(address, rpc_timeout_s=self._config.rpc_timeout_s,
                           generate_timeout_s=self._config.generate_timeout_s, tls=self._config.tls)

    async def start(self) -> ModelInfo:
        """Register the workers (see `WorkerPool.start`; those behind the DNS names too, waiting
        for the first), then keep resolving the names; the model the cluster serves."""
        if self.discovery is None:
            infos = await self.pool.start()
        else:
            infos = await self.pool.start(self.discovery.refresh)
            self._discovering = asyncio.create_task(self.discovery.run(), name="worker-dns")
        self.loras = LoraCatalog(self.pool, infos)
        return cluster_info(infos)

    def collector(self) -> RoutingCollector:
        return RoutingCollector(self.counters, self.pool, self.index)

    # ---- PoolListener --------------------------------------------------------------------------

    def worker_up(self, handle: WorkerHandle) -> None:
        if handle.address not in self._event_sources:
            self._event_sources[handle.address] = self._make_events(handle.address)
        subscriber = KvEventSubscriber(handle.address, self._event_sources[handle.address], self.index,
                                       self.counters, self.pool.mark_down, self._config.rpc_timeout_s)
        self._stop_subscriber(handle.address)
        self._subscribers[handle.address] = asyncio.create_task(subscriber.run(), name=f"kv-{handle.address}")
        if self.loras is not None and self.loras.lora_adapters():
            sync = asyncio.create_task(self.loras.sync_worker(handle), name=f"lora-{handle.address}")
            self._syncs.add(sync)
            sync.add_done_callback(self._syncs.discard)

    def worker_down(self, handle: WorkerHandle) -> None:
        self._stop_subscriber(handle.address)
        self.index.remove_worker(handle.address)

    def worker_removed(self, handle: WorkerHandle) -> None:
        """A drained worker is forgotten: close its event client (its subscriber went with `worker_down`)."""
        source = self._event_sources.pop(handle.address, None)
        if source is not None:
            self._closing.add(asyncio.create_task(source.close()))
            self._closing = {task for task in self._closing if not task.done()}

    def _stop_subscriber(self, address: WorkerId) -> None:
        task = self._subscribers.pop(address, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def close(self) -> None:
        if self._discovering is not None:
            self._discovering.cancel()
            await asyncio.gather(self._discovering, return_exceptions=True)
        tasks = [task for task in [*self._subscribers.values(), *self._syncs] if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
        self._subscribers.clear()
        await self.pool.close()
        await asyncio.gather(*(s.close() for s in self._event_sources.values()), *self._closing,
                             return_exceptions=True)

