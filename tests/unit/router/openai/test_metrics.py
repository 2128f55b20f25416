from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.ids import RequestId
from pdserve.common.request import RequestOutput
from pdserve.common.stats import EngineStats
from pdserve.router.openai.metrics import RequestTimer, RouterMetrics

STATS = EngineStats(num_running=3, num_waiting=4, num_free_blocks=10, num_total_blocks=32, num_used_blocks=22,
                    num_prefill_tokens_queued=0, prefix_cache_queried_tokens=500, prefix_cache_hit_tokens=200,
                    num_preemptions=1)


def samples(text: bytes) -> dict[str, float]:
    return {
        sample.name + (str(sorted(sample.labels.items())) if sample.labels else ""): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def output(index: int, num_tokens: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(RequestId("r"), index, tuple(range(num_tokens)), "t" * num_tokens, finish_reason=finish)


def test_worker_figures_follow_the_last_snapshot() -> None:
    metrics = RouterMetrics()
    values = samples(metrics.render(STATS))
    assert {k: values[k] for k in (
        "pdserve_worker_stats_up", "pdserve_num_requests_running", "pdserve_num_requests_waiting",
        "pdserve_kv_blocks_in_use", "pdserve_kv_blocks_total", "pdserve_prefix_cache_queries_total",
        "pdserve_prefix_cache_hits_total", "pdserve_preemptions_total")} == {
        "pdserve_worker_stats_up": 1.0, "pdserve_num_requests_running": 3.0, "pdserve_num_requests_waiting": 4.0,
        "pdserve_kv_blocks_in_use": 22.0, "pdserve_kv_blocks_total": 32.0,
        "pdserve_prefix_cache_queries_total": 500.0, "pdserve_prefix_cache_hits_total": 200.0,
        "pdserve_preemptions_total": 1.0}
    down = samples(metrics.render(None))
    assert down["pdserve_worker_stats_up"] == 0.0
    assert "pdserve_num_requests_running" not in down


def test_timer_observes_ttft_once_and_tpot_per_multi_token_choice() -> None:
    metrics = RouterMetrics()
    timer = RequestTimer(metrics)
    timer.on_output(0, output(0, 0))  # no tokens yet: not a first token
    timer.on_output(0, output(0, 1))
    timer.on_output(1, output(1, 1, "stop"))
    timer.on_output(0, output(0, 2, "length"))
    timer.finish()
    values = samples(metrics.render(None))
    assert values["pdserve_time_to_first_token_seconds_count"] == 1.0
    assert values["pdserve_time_per_output_token_seconds_count"] == 1.0  # choice 1 had a single token
    assert values["pdserve_e2e_request_latency_seconds_count"] == 1.0


def test_two_apps_never_share_series() -> None:
    first, second = RouterMetrics(), RouterMetrics()
    first.count_request("/v1/completions", 200)
    assert samples(first.render(None))["pdserve_http_requests_total[('route', '/v1/completions'), ('status', '200')]"] == 1.0
    assert not any(k.startswith("pdserve_http_requests_total[") for k in samples(second.render(None)))
