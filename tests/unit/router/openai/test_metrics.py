from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.ids import RequestId
from pdserve.common.request import RequestOutput
from pdserve.router.openai.metrics import RequestTimer, RouterMetrics


def samples(text: bytes) -> dict[str, float]:
    return {
        sample.name + (str(sorted(sample.labels.items())) if sample.labels else ""): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def output(index: int, num_tokens: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(RequestId("r"), index, tuple(range(num_tokens)), "t" * num_tokens, finish_reason=finish)


def test_the_router_exports_only_its_own_figures() -> None:
    """Worker figures are each worker's own (its --metrics-port): a router sum over the workers
    up would make counters drop when one left rotation."""
    metrics = RouterMetrics()
    metrics.count_request("/v1/completions", 200)
    names = {family.name for family in text_string_to_metric_families(metrics.render().decode())
             if not family.name.endswith("_created")}
    assert names == {"pdserve_http_requests", "pdserve_http_requests_in_progress",
                     "pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds",
                     "pdserve_e2e_request_latency_seconds"}


def test_ttft_buckets_reach_past_the_600_s_first_output_timeout() -> None:
    values = samples(RouterMetrics().render())
    assert values["pdserve_time_to_first_token_seconds_bucket[('le', '640.0')]"] == 0.0
    assert values["pdserve_e2e_request_latency_seconds_bucket[('le', '960.0')]"] == 0.0


def test_timer_observes_ttft_once_and_tpot_per_multi_token_choice() -> None:
    metrics = RouterMetrics()
    timer = RequestTimer(metrics)
    timer.on_output(0, output(0, 0))  # no tokens yet: not a first token
    timer.on_output(0, output(0, 1))
    timer.on_output(1, output(1, 1, "stop"))
    timer.on_output(0, output(0, 2, "length"))
    timer.finish()
    values = samples(metrics.render())
    assert values["pdserve_time_to_first_token_seconds_count"] == 1.0
    assert values["pdserve_time_per_output_token_seconds_count"] == 1.0  # choice 1 had a single token
    assert values["pdserve_e2e_request_latency_seconds_count"] == 1.0


def test_two_apps_never_share_series() -> None:
    first, second = RouterMetrics(), RouterMetrics()
    first.count_request("/v1/completions", 200)
    assert samples(first.render())["pdserve_http_requests_total[('route', '/v1/completions'), ('status', '200')]"] == 1.0
    assert not any(k.startswith("pdserve_http_requests_total[") for k in samples(second.render()))
