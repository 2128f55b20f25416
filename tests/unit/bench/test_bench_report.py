"""The JSON document keeps `vllm bench serve` field names; the table shows every figure."""
import math

from pdserve.bench.metrics import RequestRecord, compute_metrics
from pdserve.bench.plot import throughput_series
from pdserve.bench.report import RunInfo, format_table, percentile_key, result_json
from pdserve.bench.slo import Slo

OK = RequestRecord(index=1, start_time=0.5, queue_time=0.25, prompt_len=8, output_len=3,
                   chunk_times=(0.1, 0.2, 0.4), finish_time=0.45, generated_text="abc")
FAILED = RequestRecord(index=0, start_time=0.0, queue_time=0.0, prompt_len=5, output_len=0,
                       chunk_times=(), finish_time=0.01, error="HTTP 500: boom")


def info(slo=None, rate=math.inf):
    return RunInfo(date="20260101-000000", backend="openai", model_id="m", tokenizer_id="t",
                   dataset_name="random", num_prompts=2, request_rate=rate, burstiness=1.0,
                   max_concurrency=None, num_warmups=0, seed=0, slo=slo)


def test_percentile_keys_match_vllm_spelling():
    assert [percentile_key(p) for p in (99.0, 90.0, 99.9, 50.5)] == ["99", "90", "99.9", "50.5"]


def test_json_has_vllm_names_and_per_request_arrays_in_send_order():
    metrics = compute_metrics([OK, FAILED], 1.0, Slo(ttft_ms=150.0), (99.0, 99.9))
    document = result_json(metrics, [OK, FAILED], info(Slo(ttft_ms=150.0)))
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p99_{name}_ms",
                f"p99.9_{name}_ms"} <= document.keys()
    assert document["request_rate"] == "inf"
    assert (document["completed"], document["failed"], document["request_goodput"]) == (1, 1, 1.0)
    assert document["goodput_slo_ms"] == {"ttft": 150.0}
    assert document["input_lens"] == [5, 8]
    assert document["output_lens"] == [0, 3]
    assert document["ttfts"] == [0.0, 0.1]
    assert document["itls"][0] == [] and [round(x, 9) for x in document["itls"][1]] == [0.1, 0.2]
    assert document["latencies"] == [0.0, 0.4]
    assert document["errors"] == ["HTTP 500: boom", ""]
    assert document["queue_times"] == [0.0, 0.25]
    assert round(document["median_tpot_ms"], 9) == 150.0


def test_table_lists_counts_goodput_and_each_percentile():
    metrics = compute_metrics([OK, FAILED], 2.0, Slo(ttft_ms=150.0), (90.0, 99.0))
    table = format_table(metrics, info(Slo(ttft_ms=150.0), rate=4.0)).splitlines()
    assert "Successful requests:" in table[1] and table[1].endswith(" 1")
    assert "Failed requests:" in table[2] and table[2].endswith(" 1")
    assert [line.split(":")[0] for line in table if "TTFT" in line] == [
        "Mean TTFT (ms)", "Median TTFT (ms)", "P90 TTFT (ms)", "P99 TTFT (ms)"]
    goodput = next(line for line in table if line.startswith("Request goodput"))
    assert goodput.endswith(" 0.50")
    assert next(line for line in table if line.startswith("Goodput SLO")).endswith(" ttft=150ms")
    assert next(line for line in table if line.startswith("SLO attainment")).endswith(" 50.0")


def test_throughput_series_adds_up_to_the_totals():
    edges, tokens, requests = throughput_series([OK, FAILED], duration_s=1.0)
    width = edges[1] - edges[0]
    assert len(edges) == len(tokens) + 1 == len(requests) + 1
    assert round(sum(tokens) * width, 9) == 3.0
    assert round(sum(requests) * width, 9) == 1.0
