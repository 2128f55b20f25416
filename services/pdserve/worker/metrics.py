"""A worker's Prometheus registry, served over HTTP when `--metrics-port` is set: the model-server
series under vLLM's names (`engine_metrics.py`) and, here, pdserve's own figures of moving KV
between workers, which vLLM has no names for.

Timings: `pdserve_kv_transfer_seconds` is the write of a prompt's blocks alone, timed by the
prefill worker that makes it (the only side that sees where the prefill ends and the write
begins); `pdserve_remote_prefill_seconds` is the decode worker's wait for a peer's prefill and
its write together. Bytes, blocks and failures are counted on both sides (`direction`), and so
are the window layers' slices a hand-off leaves behind (`pdserve_kv_window_skipped_*`).
"""
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.common.api_keys import ApiKeys
from pdserve.common.metrics_http import serve_metrics
from pdserve.kvcache.windows import SkippedSlices

TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REMOTE_PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Why a decode worker prefills a prompt itself (DecodeEngine and DecodeVerdict give these).
LOCAL_PREFILL_REASONS = ("no_prefill_worker", "n_gt_1", "peer_unavailable", "few_missing_tokens", "no_free_blocks",
                         "lower_tier_read_failed", "prompt_logprobs", "lora_mismatch", "prefill_queue_full")


class TransferMetrics:
    """Counters a prefill or decode worker keeps about moving KV; owns the worker's registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved between workers", ["direction"], registry=r)
        self.blocks = Histogram("pdserve_kv_transfer_blocks", "Blocks per KV transfer", ["direction"],
                                buckets=BLOCK_BUCKETS, registry=r)
        self.transfer_seconds = Histogram("pdserve_kv_transfer_seconds",
                                          "Time to write one prompt's KV blocks to the decode worker (prefill side)",
                                          buckets=TRANSFER_BUCKETS, registry=r)
        self.remote_prefill_seconds = Histogram(
            "pdserve_remote_prefill_seconds", "Prefill order sent to its KV landed (decode side): the peer's queue, "
            "prefill and write", buckets=REMOTE_PREFILL_BUCKETS, registry=r)
        self.failures = Counter("pdserve_kv_transfer_failures", "Failed or timed-out KV transfers",
                                ["direction"], registry=r)
        self.local_prefills = Counter("pdserve_local_prefills", "Prompts a decode worker prefilled itself",
                                      ["reason"], registry=r)
        self.lease_expiries = Counter("pdserve_kv_lease_expiries", "Blocks held for a peer freed by their lease",
                                      registry=r)
        self.window_skipped_blocks = Counter(
            "pdserve_kv_window_skipped_blocks", "Prompt blocks handed off without some window layers' slices (out "
            "of their reach), or not at all", ["direction"], registry=r)
        self.window_skipped_bytes = Counter("pdserve_kv_window_skipped_bytes", "KV bytes of window layers' slices "
                                            "a hand-off left behind", ["direction"], registry=r)

    def start_at_zero(self, direction: str, local_prefill_reasons: tuple[str, ...] = ()) -> None:
        """Create a role's labelled series before their first event, so that dashboards chart 0
        rather than no data (a prefill worker sends, a decode worker receives and falls back)."""
        for series in (self.bytes, self.blocks, self.failures, self.window_skipped_blocks, self.window_skipped_bytes):
            series.labels(direction)
        for reason in local_prefill_reasons:
            self.local_prefills.labels(reason)

    def transferred(self, direction: str, num_blocks: int, num_bytes: int) -> None:
        self.bytes.labels(direction).inc(num_bytes)
        self.blocks.labels(direction).observe(num_blocks)

    def left_behind(self, direction: str, skipped: Sequence[SkippedSlices], bytes_per_layer: int) -> None:
        """A hand-off's window layers' slices that did not travel (`kvcache/windows.py`)."""
        self.window_skipped_blocks.labels(direction).inc(len(skipped))
        self.window_skipped_bytes.labels(direction).inc(sum(len(s.layers) for s in skipped) * bytes_per_layer)

    def serve(self, host: str, port: int, keys: ApiKeys | None = None) -> int:
        """Serve /metrics on `host:port` (0: any free port), to callers with one of `keys` when
        given; returns the bound port."""
        return serve_metrics(self.registry, host, port, keys)
