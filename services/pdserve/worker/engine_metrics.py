"""A worker's model-server metrics under vLLM's names, types, buckets and labels (`vllm:*`,
labelled `model_name` and `engine`, as vLLM's `PrometheusStatLogger`), so the Gateway API
Inference Extension's endpoint picker, llm-d and vLLM dashboards read pdserve workers as they
read vLLM pods; plus pdserve's own KV tier figures, which vLLM has no name for.

Every series is this process's own: counters count from the worker's start (a restart is an
ordinary counter reset), gauges are its own load. Request figures come from the engine thread
(`StepStats`, observed as they happen); load, cache and tier figures from the engine's last
snapshot, read when `/metrics` is scraped. Which worker records what, so that a sum over
workers counts each request once, is in `engine/core/request_stats.py` and the README.
"""
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.stats import EngineStats
from pdserve.engine.core.request_stats import SpecCounts, StepStats
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.engine_views import QueueView

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason strings, and ours
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's; past the 600 s first-output timeout
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def export_engine(registry: CollectorRegistry, engine: ThreadedEngine, model_name: str) -> None:
    """Put `engine`'s series in `registry`, labelled with the served model name."""
    recorder = EngineMetrics(registry, model_name, engine.info().max_model_len)
    engine.add_step_stats_listener(recorder.record)
    registry.register(EngineSnapshotCollector(engine.stats, engine.queues, model_name))
    native = engine.engine.runner.native
    kernels = Gauge("pdserve_cpu_kernels_info", "What runs the model's steps: the native kernels' ISA level "
                    "(avx2, avx512, avx512_bf16, amx) or torch ops", ["model_name", "kernels"], registry=registry)
    kernels.labels(model_name, native.level if native is not None else "torch").set(1)


class EngineMetrics:
    """The request-level series, observed from the engine thread's `StepStats`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, engine: str = "0") -> None:
        values = (model_name, engine)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*values)

        tokens = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", tokens)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", [*LABELS, "position"], registry=registry)
        self.spec_accepted_at = lambda position: per_pos.labels(*values, str(position))

    def record(self, stats: StepStats) -> None:
        """Observe one batch of the engine's figures (on the engine thread; never blocks)."""
        self.generation_tokens.inc(stats.num_generation_tokens)
        for num_tokens in stats.step_tokens:
            self.iteration_tokens.observe(num_tokens)
        for ttft in stats.ttfts_s:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_s:
            self.itl.observe(itl)
        for done in stats.prefills:
            self.prompt_tokens.inc(done.num_prompt_tokens)
            self.queue.observe(done.queue_s)
            self.prefill.observe(done.prefill_s)
        self._record_spec(stats.spec)
        for seq in stats.finished:
            self.success[seq.finish_reason].inc()
            self.e2e.observe(seq.e2e_s)
            self.request_prompt.observe(seq.num_prompt_tokens)
            self.request_generation.observe(seq.num_generation_tokens)
            if seq.inference_s is not None:
                self.inference.observe(seq.inference_s)
            if seq.decode_s is not None:
                self.decode.observe(seq.decode_s)


    def _record_spec(self, counts: SpecCounts) -> None:
        if not counts:
            return
        self.spec_drafts.inc(counts.num_drafts)
        self.spec_draft_tokens.inc(counts.num_draft_tokens)
        self.spec_accepted.inc(counts.num_accepted_tokens)
        for position, num_accepted in enumerate(counts.accepted_per_pos):
            self.spec_accepted_at(position).inc(num_accepted)


class EngineSnapshotCollector(Collector):
    """Load, prefix-cache and KV tier series from the engine's last snapshot, read at scrape time
    (the snapshot is replaced whole by the engine thread, so reading it needs no lock)."""

    def __init__(self, stats: Callable[[], EngineStats], queues: Callable[[], QueueView], model_name: str,
                 max_loras: int = 0, engine: str = "0") -> None:
        self._stats = stats
        self._queues = queues
        self._values = [model_name, engine]
        self._max_loras = max_loras

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stats, queues = self._stats(), self._queues()
        yield from self._vllm(stats, queues)
        yield self._lora_info(queues)
        yield from _tier_series(stats)

    def _vllm(self, stats: EngineStats, queues: QueueView) -> Iterator[Metric]:
        waiting = stats.num_waiting + queues.num_awaiting_kv
        gauges = (("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage))
        counters = (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                     stats.prefix_cache_queried_tokens),
                    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     stats.prefix_cache_hit_tokens),
                    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.num_preemptions))
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._values, value)
            yield family
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._values, value)
            yield family

    def _lora_info(self, queues: QueueView) -> Metric:
        """vLLM's `lora_requests_info`: adapters in use as label values, the value the time of
        the reading (vLLM sets it to the current time at each record)."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([str(self._max_loras), ",".join(queues.waiting_adapters), ",".join(queues.running_adapters)],
                          time.time())
        return family


def _tier_series(stats: EngineStats) -> Iterator[Metric]:
    gauges = {
        "pdserve_kv_blocks_in_use": ("KV blocks referenced by requests", stats.num_used_blocks),
        "pdserve_kv_blocks": ("KV blocks in the worker's device pool", stats.num_total_blocks),
        "pdserve_kv_host_blocks": ("KV blocks the host tier can hold", stats.num_host_blocks),
        "pdserve_kv_host_cached_blocks": ("KV blocks held in the host tier", stats.num_host_cached_blocks),
        "pdserve_kv_disk_blocks": ("KV blocks the disk tier can hold", stats.num_disk_blocks),
        "pdserve_kv_disk_cached_blocks": ("KV blocks held in the disk tier", stats.num_disk_cached_blocks),
        "pdserve_kv_host_cached_bytes": ("Bytes of KV blocks held in the host tier", stats.num_host_cached_bytes),
        "pdserve_kv_disk_cached_bytes": ("Bytes of KV block files in the disk tier", stats.num_disk_cached_bytes),
    }
    counters = {
        "pdserve_kv_offloaded_blocks": ("KV blocks copied from the device to the host tier", stats.num_offloaded_blocks),
        "pdserve_kv_onboarded_blocks": ("KV blocks copied back from the host tier (prefix hits there)",
                                        stats.num_onboarded_blocks),
        "pdserve_kv_spilled_blocks": ("KV blocks written from the host tier to disk", stats.num_spilled_blocks),
        "pdserve_kv_loaded_blocks": ("KV blocks read back from disk (prefix hits there)", stats.num_loaded_blocks),
        "pdserve_kv_disk_corrupt_blocks": ("Disk block files that failed their checksum (used as misses)",
                                           stats.num_corrupt_disk_blocks),
        "pdserve_prefix_cache_host_hits": ("Prompt tokens found in the host tier (part of vllm:prefix_cache_hits)",
                                           stats.prefix_cache_host_hit_tokens),
        "pdserve_prefix_cache_disk_hits": ("Prompt tokens found in the disk tier (part of vllm:prefix_cache_hits)",
                                           stats.prefix_cache_disk_hit_tokens),
        "pdserve_kv_dropped_by_priority_blocks": ("KV blocks dropped on eviction because their retention priority "
                                                  "is below --secondary-offload-min-priority",
                                                  stats.num_dropped_by_priority),
    }
    for name, (doc, value) in gauges.items():
        yield GaugeMetricFamily(name, doc, value=value)
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)
