"""A worker's model-server series: vLLM's names, types, buckets and labels, from the engine's
step figures and its last snapshot."""
import dataclasses

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.stats import EngineStats
from pdserve.engine.core.request_stats import FinishedSeq, PrefillDone, SpecCounts, StepStats
from pdserve.worker.engine_views import QueueView
from pdserve.worker.engine_metrics import EngineMetrics, EngineSnapshotCollector, build_1_2_5_buckets

LABELS = {"model_name": "tiny", "engine": "0"}
STATS = dataclasses.replace(EngineStats(*([0] * 9)), num_running=3, num_waiting=4, num_total_blocks=32,
                            num_used_blocks=8, prefix_cache_queried_tokens=500, prefix_cache_hit_tokens=200,
                            num_preemptions=1, num_offloaded_blocks=6)


def families(registry: CollectorRegistry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def value(family, suffix: str = "", **labels) -> float:
    (sample,) = [s for s in family.samples if s.name == family.name + suffix and labels.items() <= s.labels.items()]
    return sample.value


def test_step_figures_become_vllms_request_series() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny", max_model_len=512)
    metrics.record(StepStats(num_generation_tokens=5, ttfts_s=[0.3], inter_token_s=[0.02, 0.04],
                             prefills=[PrefillDone(0.5, 0.25, 21)],
                             finished=[FinishedSeq("stop", 2.0, 1.5, 1.25, 21, 5),
                                       FinishedSeq("abort", 0.1, None, None, 7, 0)], step_tokens=[21, 1]))
    found = families(registry)
    assert value(found["vllm:prompt_tokens"], "_total", **LABELS) == 21
    assert value(found["vllm:generation_tokens"], "_total", **LABELS) == 5
    success = found["vllm:request_success"]
    assert {s.labels["finished_reason"]: s.value for s in success.samples if s.name.endswith("_total")} == {
        "stop": 1.0, "length": 0.0, "abort": 1.0, "error": 0.0}
    counts = {name: value(found[name], "_count", **LABELS) for name in (
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens")}
    assert counts == {"vllm:time_to_first_token_seconds": 1, "vllm:inter_token_latency_seconds": 2,
                      "vllm:e2e_request_latency_seconds": 2, "vllm:request_queue_time_seconds": 1,
                      "vllm:request_prefill_time_seconds": 1, "vllm:request_decode_time_seconds": 1,
                      "vllm:request_inference_time_seconds": 1, "vllm:request_prompt_tokens": 2,
                      "vllm:request_generation_tokens": 2}
    assert value(found["vllm:request_decode_time_seconds"], "_sum", **LABELS) == 1.25
    assert value(found["vllm:inter_token_latency_seconds"], "_sum", **LABELS) == 0.06
    steps = found["vllm:iteration_tokens_total"]
    assert value(steps, "_count", **LABELS) == 2 and value(steps, "_sum", **LABELS) == 22
    assert value(steps, "_bucket", le="1.0", **LABELS) == 1 and value(steps, "_bucket", le="16.0", **LABELS) == 1


def test_speculative_counts_become_vllms_spec_decode_series() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny", max_model_len=512)
    metrics.record(StepStats(spec=SpecCounts(3, 10, 5, [3, 2])))
    metrics.record(StepStats(spec=SpecCounts(1, 4, 1, [1])))
    found = families(registry)
    assert value(found["vllm:spec_decode_num_drafts"], "_total", **LABELS) == 4
    assert value(found["vllm:spec_decode_num_draft_tokens"], "_total", **LABELS) == 14
    assert value(found["vllm:spec_decode_num_accepted_tokens"], "_total", **LABELS) == 6
    per_pos = found["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert {s.labels["position"]: s.value for s in per_pos.samples if s.name.endswith("_total")} == {"0": 4.0, "1": 2.0}


def test_ttft_buckets_reach_past_the_600_s_first_output_timeout_and_token_buckets_the_model_length() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, "tiny", max_model_len=512)
    found = families(registry)
    ttft_bounds = [float(s.labels["le"]) for s in found["vllm:time_to_first_token_seconds"].samples if "le" in s.labels]
    assert ttft_bounds[-2:] == [2560.0, float("inf")]
    prompt_bounds = [s.labels["le"] for s in found["vllm:request_prompt_tokens"].samples if "le" in s.labels]
    assert prompt_bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_the_snapshot_gives_load_cache_and_tier_series_with_their_types() -> None:
    registry = CollectorRegistry()
    queues = QueueView(num_awaiting_kv=2, running_adapters=("7",), waiting_adapters=("3", "7"))
    registry.register(EngineSnapshotCollector(lambda: STATS, lambda: queues, "tiny", max_loras=4))
    found = families(registry)
    assert {name: (found[name].type, value(found[name], suffix, **LABELS)) for name, suffix in (
        ("vllm:num_requests_running", ""), ("vllm:num_requests_waiting", ""), ("vllm:kv_cache_usage_perc", ""),
        ("vllm:prefix_cache_queries", "_total"), ("vllm:prefix_cache_hits", "_total"),
        ("vllm:num_preemptions", "_total"))} == {
        "vllm:num_requests_running": ("gauge", 3.0), "vllm:num_requests_waiting": ("gauge", 6.0),  # 4 + 2 for KV
        "vllm:kv_cache_usage_perc": ("gauge", 0.25), "vllm:prefix_cache_queries": ("counter", 500.0),
        "vllm:prefix_cache_hits": ("counter", 200.0), "vllm:num_preemptions": ("counter", 1.0)}
    (lora,) = found["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "4", "running_lora_adapters": "7", "waiting_lora_adapters": "3,7"}
    assert (found["pdserve_kv_blocks"].type, value(found["pdserve_kv_blocks"])) == ("gauge", 32.0)
    assert (found["pdserve_kv_offloaded_blocks"].type, value(found["pdserve_kv_offloaded_blocks"], "_total")) == (
        "counter", 6.0)
    assert "pdserve_kv_blocks_total" not in generate_latest(registry).decode()
