"""The end-of-run table and the JSON result (field names of `vllm bench serve`)."""
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.metrics import BenchmarkMetrics, Distribution, RequestRecord
from pdserve.bench.slo import Slo

METRIC_TITLES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (excl. 1st token)",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}
WIDTH = 56


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What was run, echoed into the table and the JSON (vLLM key names where they exist)."""

    date: str  # YYYYMMDD-HHMMSS
    backend: str  # "openai" (completions) or "openai-chat"
    model_id: str
    tokenizer_id: str
    dataset_name: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    num_warmups: int
    seed: int
    slo: Slo | None


def percentile_key(percentile: float) -> str:
    """99 -> "99", 99.9 -> "99.9": the spelling inside `p99_ttft_ms`."""
    return str(int(percentile)) if float(percentile).is_integer() else str(percentile)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _line(label: str, value: object) -> str:
    return f"{label + ':':<42}{value:>{WIDTH - 42}}"


def _distribution_lines(name: str, dist: Distribution) -> list[str]:
    label = name.upper()
    lines = [f" {METRIC_TITLES[name]} ".center(WIDTH, "-")]
    lines += [_line(f"Mean {label} (ms)", _ms(dist.mean)), _line(f"Median {label} (ms)", _ms(dist.median))]
    lines += [_line(f"P{percentile_key(p)} {label} (ms)", _ms(v)) for p, v in dist.percentiles]
    return lines


def format_table(metrics: BenchmarkMetrics, info: RunInfo) -> str:
    """The human-readable summary printed at the end of a run."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             _line("Successful requests", metrics.completed),
             _line("Failed requests", metrics.failed),
             _line("Benchmark duration (s)", f"{metrics.duration_s:.2f}"),
             _line("Total input tokens", metrics.total_input_tokens),
             _line("Total generated tokens", metrics.total_output_tokens),
             _line("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
             _line("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
             _line("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
             _line("Peak output token throughput (tok/s)", f"{metrics.max_output_tokens_per_s:.2f}"),
             _line("Peak concurrent requests", metrics.max_concurrent_requests)]
    if info.slo is not None:
        bounds = ",".join(f"{k}={v:g}ms" for k, v in info.slo.as_dict().items())
        lines += [_line("Goodput SLO", bounds),
                  _line("Request goodput (req/s)", f"{metrics.request_goodput:.2f}"),
                  _line("SLO attainment (% of sent requests)", f"{100 * metrics.slo_attainment:.1f}")]
    for name, dist in metrics.latencies.items():
        lines += _distribution_lines(name, dist)
    return "\n".join(lines + ["=" * WIDTH])


def _latency_fields(metrics: BenchmarkMetrics) -> dict:
    fields = {}
    for name, dist in metrics.latencies.items():
        fields[f"mean_{name}_ms"] = dist.mean
        fields[f"median_{name}_ms"] = dist.median
        fields[f"std_{name}_ms"] = dist.std
        fields.update({f"p{percentile_key(p)}_{name}_ms": v for p, v in dist.percentiles})
    return fields


def result_json(metrics: BenchmarkMetrics, records: list[RequestRecord], info: RunInfo) -> dict:
    """The `--json` document. Per-request arrays follow send order (by start time)."""
    ordered = sorted(records, key=lambda r: r.start_time)
    rate = info.request_rate if math.isfinite(info.request_rate) else "inf"
    return {
        "date": info.date, "backend": info.backend, "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id, "dataset_name": info.dataset_name,
        "num_prompts": info.num_prompts, "request_rate": rate, "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency, "num_warmups": info.num_warmups, "seed": info.seed,
        "goodput_slo_ms": None if info.slo is None else info.slo.as_dict(),
        "duration": metrics.duration_s, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input_tokens, "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput, "request_goodput": metrics.request_goodput,
        "slo_attainment": metrics.slo_attainment, "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        **_latency_fields(metrics),
        "input_lens": [r.prompt_len for r in ordered],
        "output_lens": [r.output_len for r in ordered],
        "ttfts": [r.ttft if r.is_success else 0.0 for r in ordered],
        "itls": [r.itls if r.is_success else [] for r in ordered],
        "latencies": [r.latency if r.is_success else 0.0 for r in ordered],
        "start_times": [r.start_time for r in ordered],
        "queue_times": [r.queue_time for r in ordered],
        "generated_texts": [r.generated_text for r in ordered],
        "errors": [r.error or "" for r in ordered],
    }


def write_json(path: str, document: dict) -> None:
    Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
