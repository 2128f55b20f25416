"""Prometheus metrics of one router app, in a registry of its own (two apps never share series).

The router exports only what it measures itself: HTTP requests by route and status, requests in
progress, and latencies as the client sees them (routing, tokenization and gRPC included) under
`pdserve_*` names; TTFT and end-to-end latency use vLLM's buckets, which reach past the 600 s
first-output timeout. Model-server series (`vllm:*`, load, KV cache) are each worker's own, on its
`--metrics-port`: a router that summed the workers currently up would make counters drop whenever
a worker left rotation.
"""
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.common.request import RequestOutput

# vLLM's time_to_first_token_seconds and e2e_request_latency_seconds buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
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
            "pdserve_time_to_first_token_seconds", "HTTP request arrival to its first generated token",
            buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds", "Mean time per token after the first, per choice",
            buckets=_TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "HTTP request arrival to its last token",
            buckets=E2E_BUCKETS, registry=reg)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


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
