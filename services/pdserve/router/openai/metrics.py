"""Prometheus metrics of one router app, in a registry of its own (two apps never share series).

Latencies are observed here as the router sees them: time to first token and end-to-end per
HTTP request, time per output token per completion choice. Load and prefix-cache figures are
the worker's, refreshed from `GenerateBackend.stats()` when `/metrics` is scraped.
"""
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.request import RequestOutput
from pdserve.common.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "pdserve_http_requests", "HTTP requests answered, by route and status code",
            ["route", "status"], registry=reg)
        self.in_progress = Gauge(
            "pdserve_http_requests_in_progress", "Generation requests in progress (bounded by --max-pending-requests)",
            registry=reg)
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds", "Mean time per token after the first, per choice",
            buckets=_TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Request arrival to its last token",
            buckets=_LATENCY_BUCKETS, registry=reg)
        self.worker = WorkerStatsCollector()
        reg.register(self.worker)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self, stats: EngineStats | None) -> bytes:
        """The exposition text, with worker figures from `stats` (None: the query failed)."""
        self.worker.stats = stats
        return generate_latest(self.registry)


class WorkerStatsCollector(Collector):
    """Exposes the worker's last `EngineStats` snapshot; cumulative figures as counters."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())  # series depend on whether a snapshot exists

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield GaugeMetricFamily("pdserve_worker_stats_up", "1 if the last stats query succeeded",
                                value=0 if stats is None else 1)
        if stats is None:
            return
        gauges = {
            "pdserve_num_requests_running": ("Requests in the worker's batch", stats.num_running),
            "pdserve_num_requests_waiting": ("Requests queued in the worker", stats.num_waiting),
            "pdserve_kv_blocks_in_use": ("KV blocks referenced by requests", stats.num_used_blocks),
            "pdserve_kv_blocks_total": ("KV blocks in the worker's pool", stats.num_total_blocks),
            "pdserve_kv_host_blocks": ("KV blocks the host tier can hold", stats.num_host_blocks),
            "pdserve_kv_host_cached_blocks": ("KV blocks held in the host tier", stats.num_host_cached_blocks),
            "pdserve_kv_disk_blocks": ("KV blocks the disk tier can hold", stats.num_disk_blocks),
            "pdserve_kv_disk_cached_blocks": ("KV blocks held in the disk tier", stats.num_disk_cached_blocks),
            "pdserve_kv_host_cached_bytes": ("Bytes of KV blocks held in the host tier", stats.num_host_cached_bytes),
            "pdserve_kv_disk_cached_bytes": ("Bytes of KV block files in the disk tier", stats.num_disk_cached_bytes),
        }
        counters = {
            "pdserve_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                             stats.prefix_cache_queried_tokens),
            "pdserve_prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats.prefix_cache_hit_tokens),
            "pdserve_preemptions": ("Requests preempted by the worker", stats.num_preemptions),
            "pdserve_kv_offloaded_blocks": ("KV blocks copied from the device to the host tier",
                                            stats.num_offloaded_blocks),
            "pdserve_kv_onboarded_blocks": ("KV blocks copied back from the host tier (prefix hits there)",
                                            stats.num_onboarded_blocks),
            "pdserve_kv_spilled_blocks": ("KV blocks written from the host tier to disk", stats.num_spilled_blocks),
            "pdserve_kv_loaded_blocks": ("KV blocks read back from disk (prefix hits there)", stats.num_loaded_blocks),
            "pdserve_kv_disk_corrupt_blocks": ("Disk block files that failed their checksum (used as misses)",
                                               stats.num_corrupt_disk_blocks),
            "pdserve_prefix_cache_host_hits": ("Prompt tokens found in the host tier (part of the prefix cache hits)",
                                               stats.prefix_cache_host_hit_tokens),
            "pdserve_prefix_cache_disk_hits": ("Prompt tokens found in the disk tier (part of the prefix cache hits)",
                                               stats.prefix_cache_disk_hit_tokens),
            "pdserve_kv_dropped_by_priority_blocks": ("KV blocks dropped on eviction because their retention priority "
                                                      "is below --secondary-offload-min-priority",
                                                      stats.num_dropped_by_priority),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


@dataclass(slots=True)
class _ChoiceClock:
    first_token_at: float
    last_token_at: float
    num_tokens: int


@dataclass(slots=True)
class RequestTimer:
    """Latency bookkeeping for one HTTP request; choices are keyed by their response index."""

    metrics: RouterMetrics
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    choices: dict[int, _ChoiceClock] = field(default_factory=dict)

    def on_output(self, choice_index: int, output: RequestOutput) -> None:
        if not output.token_ids:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.started_at)
        clock = self.choices.get(choice_index)
        if clock is None:
            self.choices[choice_index] = _ChoiceClock(now, now, len(output.token_ids))
            return
        clock.last_token_at = now
        clock.num_tokens += len(output.token_ids)

    def finish(self) -> None:
        """Observe end-to-end and per-choice TPOT; call once, after the last output."""
        self.metrics.e2e.observe(time.monotonic() - self.started_at)
        for clock in self.choices.values():
            if clock.num_tokens > 1:
                self.metrics.tpot.observe((clock.last_token_at - clock.first_token_at) / (clock.num_tokens - 1))
