"""A worker's metrics port keeps vLLM's `vllm:` names whatever format the scraper prefers:
Prometheus asks for OpenMetrics first, in which prometheus_client would write `vllm_`."""
import httpx
from prometheus_client import CollectorRegistry, Counter

from pdserve.common.metrics_http import serve_metrics

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus sends


def test_a_scraper_preferring_openmetrics_gets_the_text_format_with_colon_names() -> None:
    registry = CollectorRegistry()
    Counter("vllm:request_success", "requests", ["model_name"], registry=registry).labels("m").inc()
    port = serve_metrics(registry, "127.0.0.1", 0)
    answer = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=10)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    assert 'vllm:request_success_total{model_name="m"} 1.0' in answer.text
    assert "vllm_request_success" not in answer.text
