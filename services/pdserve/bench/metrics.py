"""Per-request records and the aggregates `pdserve bench` reports.

Definitions (client side, `time.perf_counter`; see the README's Benchmarking section):
- a *token chunk* is an SSE event whose first choice carries non-empty text;
- TTFT = first token chunk − send; E2EL = last token chunk − send;
- TPOT = (E2EL − TTFT) / (output tokens − 1), per request, only when output tokens > 1;
- ITL = every gap between consecutive token chunks, pooled over all requests;
- failed requests are left out of every latency and throughput figure.
"""
from dataclasses import dataclass

import numpy as np

from pdserve.bench.slo import Slo


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did. Times are seconds after the request was sent.

    Invariant (the client guarantees it): a success has at least one token chunk, so
    `ttft`, `latency` and `itls` are defined for every record with `error is None`.
    """

    index: int  # position in the order responses ended
    start_time: float  # seconds after the benchmark start when the request was sent
    queue_time: float  # seconds spent waiting for a --max-concurrency slot
    prompt_len: int
    output_len: int
    chunk_times: tuple[float, ...]  # arrival of each token chunk
    finish_time: float  # when the response ended (success or failure)
    generated_text: str = ""
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0]

    @property
    def latency(self) -> float:
        return self.chunk_times[-1]

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of one latency metric in milliseconds; None fields when there were no samples."""

    mean: float | None
    median: float | None
    std: float | None
    percentiles: tuple[tuple[float, float | None], ...]  # (percentile, value)

    @classmethod
    def of(cls, samples_s: list[float], percentiles: tuple[float, ...]) -> "Distribution":
        if not samples_s:
            return cls(None, None, None, tuple((p, None) for p in percentiles))
        ms = np.asarray(samples_s, dtype=np.float64) * 1000.0
        values = tuple((p, float(np.percentile(ms, p))) for p in percentiles)
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), values)


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # requests/s meeting every SLO bound; None without --slo
    slo_attainment: float | None  # fraction of all sent requests meeting the SLO
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latencies: dict[str, Distribution]  # "ttft" | "tpot" | "itl" | "e2el"


def is_good(record: RequestRecord, slo: Slo) -> bool:
    """A request counts toward goodput when it succeeded and met every SLO bound.

    One-token outputs have no TPOT and count as TPOT 0, as in `vllm bench serve`.
    """
    if not record.is_success:
        return False
    tpot = record.tpot or 0.0
    return slo.is_met(record.ttft * 1000.0, tpot * 1000.0, record.latency * 1000.0)


def token_events(records: list[RequestRecord]) -> list[tuple[float, float]]:
    """(time after benchmark start, tokens) per token chunk of successful requests.

    A request's output tokens are spread evenly over its chunks, so servers that send
    several tokens per chunk still add up to the server-reported total.
    """
    events = []
    for record in records:
        if record.is_success:
            per_chunk = record.output_len / len(record.chunk_times)
            events += [(record.start_time + t, per_chunk) for t in record.chunk_times]
    return events


def max_output_tokens_per_s(records: list[RequestRecord]) -> float:
    """Most output tokens that arrived within any one-second bucket of the run."""
    buckets: dict[int, float] = {}
    for when, tokens in token_events(records):
        buckets[int(when)] = buckets.get(int(when), 0.0) + tokens
    return max(buckets.values(), default=0.0)


def max_concurrent_requests(records: list[RequestRecord]) -> int:
    """Most requests in flight at once (sweep over send and end times, all requests)."""
    edges = []
    for record in records:
        edges += [(record.start_time, 1), (record.start_time + record.finish_time, -1)]
    in_flight = peak = 0
    for _, step in sorted(edges):  # at equal times an end (-1) sorts before a start
        in_flight += step
        peak = max(peak, in_flight)
    return peak


def latency_distributions(
    succeeded: list[RequestRecord], percentiles: tuple[float, ...]
) -> dict[str, Distribution]:
    samples = {
        "ttft": [r.ttft for r in succeeded],
        "tpot": [r.tpot for r in succeeded if r.tpot is not None],
        "itl": [gap for r in succeeded for gap in r.itls],
        "e2el": [r.latency for r in succeeded],
    }
    return {name: Distribution.of(values, percentiles) for name, values in samples.items()}


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    slo: Slo | None,
    percentiles: tuple[float, ...],
) -> BenchmarkMetrics:
    """Aggregate a run. `duration_s` spans the first send to the last response (> 0)."""
    succeeded = [r for r in records if r.is_success]
    input_tokens = sum(r.prompt_len for r in succeeded)
    output_tokens = sum(r.output_len for r in succeeded)
    num_good = sum(is_good(r, slo) for r in records) if slo else None
    return BenchmarkMetrics(
        duration_s=duration_s,
        completed=len(succeeded),
        failed=len(records) - len(succeeded),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(succeeded) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        request_goodput=None if num_good is None else num_good / duration_s,
        slo_attainment=None if num_good is None or not records else num_good / len(records),
        max_output_tokens_per_s=max_output_tokens_per_s(records),
        max_concurrent_requests=max_concurrent_requests(records),
        latencies=latency_distributions(succeeded, percentiles),
    )
