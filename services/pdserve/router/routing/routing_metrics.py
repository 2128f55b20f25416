"""Routing figures: what the router decided (counters it keeps) and what it knows of each
worker (read from the pool and the index when `/metrics` is scraped).

Routed hits: `pdserve_router_routed_overlap_blocks_total / pdserve_router_routed_prompt_blocks_total`
per worker and role is the share of prompt blocks the chosen worker held, as the index saw it.
"""
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.ids import WorkerId
from pdserve.router.routing.prefix_index import Overlap, PrefixIndex
from pdserve.router.routing.worker_pool import WorkerPool


class RoutingCounters:
    """Plain counters, keyed by label values; exported by `RoutingCollector`."""

    def __init__(self) -> None:
        self.routed: Counter[tuple[str, str]] = Counter()  # (worker, role)
        self.prompt_blocks: Counter[tuple[str, str]] = Counter()
        self.overlap_blocks: Counter[tuple[str, str]] = Counter()
        self.resyncs: Counter[tuple[str, str]] = Counter()  # (worker, reason)
        self.retries: Counter[str] = Counter()  # worker that failed before the first output
        self.migrations: Counter[str] = Counter()  # decode worker that failed mid-stream, its request continued
        self.num_decode_only_fallbacks = 0
        self.num_local_prefills_instead = 0  # a prefill worker was chosen; the decode worker prefilled itself
        self.num_local_prefills_for_queue = 0  # the prefill worker's queue was deep: sent to prefill on decode

    def count_route(self, worker: WorkerId, role: str, num_prompt_blocks: int, overlap: Overlap) -> None:
        self.routed[worker, role] += 1
        self.prompt_blocks[worker, role] += num_prompt_blocks
        self.overlap_blocks[worker, role] += overlap.num_blocks

    def count_resync(self, worker: WorkerId, reason: str) -> None:
        self.resyncs[worker, reason] += 1


def _counter(name: str, doc: str, labels: list[str], values: Counter) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family


class RoutingCollector(Collector):
    def __init__(self, counters: RoutingCounters, pool: WorkerPool, index: PrefixIndex) -> None:
        self._counters = counters
        self._pool = pool
        self._index = index

    def describe(self) -> Iterator[Metric]:
        return iter(())  # series depend on the workers

    def collect(self) -> Iterator[Metric]:
        c = self._counters
        role_labels = ["worker", "role"]
        yield _counter("pdserve_router_routed_requests", "Requests routed to a worker, by its role in them",
                       role_labels, c.routed)
        yield _counter("pdserve_router_routed_prompt_blocks", "Prompt blocks of routed requests",
                       role_labels, c.prompt_blocks)
        yield _counter("pdserve_router_routed_overlap_blocks",
                       "Prompt blocks the chosen worker held when routed (by the prefix index)",
                       role_labels, c.overlap_blocks)
        yield _counter("pdserve_router_index_resyncs", "Prefix index rebuilds of a worker from its snapshot",
                       ["worker", "reason"], c.resyncs)
        yield _counter("pdserve_router_dispatch_retries",
                       "Requests sent to another worker after this one failed before answering", ["worker"], c.retries)
        yield _counter("pdserve_router_migrations",
                       "Requests continued on another decode worker after this one failed mid-stream",
                       ["worker"], c.migrations)
        yield CounterMetricFamily("pdserve_router_decode_only_fallbacks",
                                  "Requests prefilled on their decode worker because no prefill worker was up",
                                  value=c.num_decode_only_fallbacks)
        yield CounterMetricFamily("pdserve_router_local_prefills_instead",
                                  "Requests routed to a prefill worker whose decode worker prefilled them itself",
                                  value=c.num_local_prefills_instead)
        yield CounterMetricFamily("pdserve_router_local_prefills_for_queue",
                                  "Requests a decode worker was sent to prefill itself: the prefill worker's queue "
                                  "was deep (--local-prefill-queue-tokens)", value=c.num_local_prefills_for_queue)
        yield from self._worker_gauges()

    def _worker_gauges(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("pdserve_router_worker_up", "1 while the worker is in rotation", labels=["worker", "role"])
        synced = GaugeMetricFamily("pdserve_router_index_synced", "1 while the worker's index part follows its events",
                                   labels=["worker"])
        blocks = GaugeMetricFamily("pdserve_router_index_blocks", "Blocks the index holds for the worker",
                                   labels=["worker"])
        requests = GaugeMetricFamily("pdserve_router_worker_requests", "Running + waiting requests, as last reported",
                                     labels=["worker"])
        queried = CounterMetricFamily("pdserve_router_worker_prefix_cache_queries",
                                      "Prompt tokens the worker looked up in its prefix cache", labels=["worker"])
        hits = CounterMetricFamily("pdserve_router_worker_prefix_cache_hits",
                                   "Prompt tokens the worker found in its prefix cache", labels=["worker"])
        for address, handle in sorted(self._pool.handles.items()):
            up.add_metric([address, str(handle.role or "unknown")], 1 if handle.is_up else 0)
            synced.add_metric([address], 1 if self._index.is_synced(address) else 0)
            blocks.add_metric([address], self._index.num_blocks(address))
            if handle.stats is not None:
                requests.add_metric([address], handle.stats.num_running + handle.stats.num_waiting)
                queried.add_metric([address], handle.stats.prefix_cache_queried_tokens)
                hits.add_metric([address], handle.stats.prefix_cache_hit_tokens)
        yield from (up, synced, blocks, requests, queried, hits)
