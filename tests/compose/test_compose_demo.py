"""The docker-compose demo, run for real: a router, two prefill workers and a decode worker in
their own containers on one compose network, found by the router through DNS names
(`--worker-dns`) under mutual TLS, KV blocks moving between the workers over NIXL/UCX on TCP,
Prometheus scraping all four. `pytest -m compose -rs` runs this alone.

The tests share one demo and run in file order; the last one takes it down and checks that
nothing of it (nor of the test's own Docker daemon) is left.
"""
import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from pdserve.engine.model.native import cpu_levels
from pdserve.worker.__main__ import CPU_BLOCK_SIZE
from tests.compose.bench_step import batch1_tpot
from tests.compose.conftest import MAX_TOKENS, PROMPTS, complete, kernels_of
from tests.compose.demo import PREFILL_SERVICES, Demo, sample, wait_until
from tests.compose.docker_host import DockerHost

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
RESTART_TIMEOUT_S = 180.0
SCRAPE_TIMEOUT_S = 90.0
BLOCK_SIZE = CPU_BLOCK_SIZE  # the compose file leaves the default, and its workers run on CPUs


def test_every_worker_runs_the_prebuilt_native_kernels_of_the_cpus_best_level(demo: Demo):
    """The image has no compiler: the kernels came compiled in the wheel, and each worker says
    which level it runs, in its start-up log and in its metrics."""
    best = cpu_levels()[-1] if cpu_levels() else "torch"
    for name in (*PREFILL_SERVICES, "decode"):
        log = demo.logs(name)
        assert kernels_of(log) == best, f"{name}: {log[-2000:]}"
        assert f"native CPU kernels: {best} (prebuilt)" in log or best == "torch"
        series = [line for line in demo.worker_metrics(name).splitlines()
                  if line.startswith("pdserve_cpu_kernels_info{")]
        assert len(series) == 1 and f'kernels="{best}"' in series[0] and series[0].endswith(" 1.0"), series


def test_greedy_outputs_through_the_router_equal_the_aggregated_server_on_the_host(demo: Demo, reference):
    for prompt in PROMPTS:
        got, want = complete(demo.url, prompt), reference[prompt]
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt[:40]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        assert got["usage"] == want["usage"]


def test_the_router_found_both_prefill_workers_and_the_decode_worker_by_name(demo: Demo):
    def workers_up() -> dict[str, int]:
        lines = httpx.get(f"{demo.url}/metrics", timeout=10).text.splitlines()
        up = [line for line in lines if line.startswith("pdserve_router_worker_up{") and line.endswith(" 1.0")]
        return {role: sum(f'role="{role}"' in line for line in up) for role in ("prefill", "decode")}

    wait_until(lambda: workers_up() == {"prefill": 2, "decode": 1}, SCRAPE_TIMEOUT_S,
               "the router has two prefill workers and one decode worker in rotation")


def test_kv_blocks_cross_from_the_prefill_to_the_decode_container(demo: Demo):
    workers = (*PREFILL_SERVICES, "decode")
    before = {name: demo.worker_metrics(name) for name in workers}
    # A prompt neither worker has seen: the decode worker has no prefix of it to reuse.
    prompt = " ".join(f"Row {i}: {i * 7} blue cars and {i * 3} yellow vans." for i in range(1, 30))
    answer = complete(demo.url, prompt, max_tokens=4)
    after = {name: demo.worker_metrics(name) for name in workers}

    def delta(worker: str, name: str, direction: str) -> float:
        label = f'direction="{direction}"'
        return sample(after[worker], name, label) - sample(before[worker], name, label)

    sent = sum(delta(name, "pdserve_kv_transfer_bytes_total", "sent") for name in PREFILL_SERVICES)
    received = delta("decode", "pdserve_kv_transfer_bytes_total", "received")
    blocks = delta("decode", "pdserve_kv_transfer_blocks_sum", "received")
    print(f"KV over NIXL/UCX: {received:.0f} bytes in {blocks:.0f} blocks for "
          f"{answer['usage']['prompt_tokens']} prompt tokens")
    assert received > 0 and received == sent
    assert blocks >= answer["usage"]["prompt_tokens"] // BLOCK_SIZE  # every full block of the prompt


def test_prometheus_scrapes_every_pdserve_target_and_the_dashboard_finds_its_series(demo: Demo):
    def all_up() -> bool:
        up = {r["metric"]["instance"]: r["value"][1] for r in demo.prometheus("up")}
        return up == {"router:8000": "1", "prefill-a:9100": "1", "prefill-b:9100": "1", "decode:9100": "1"}

    wait_until(all_up, SCRAPE_TIMEOUT_S, "Prometheus sees the router and the three workers up")
    complete(demo.url, PROMPTS[0], max_tokens=2)  # traffic inside the dashboard's rate window
    queries = dashboard_queries()
    assert len(queries) >= 8
    for query in queries:
        # Every panel shows data: each query returns series Prometheus actually holds.
        wait_until(lambda: demo.prometheus(query) != [], SCRAPE_TIMEOUT_S, f"series for {query}")
    if "grafana" in demo.services:  # only where its image can be pulled
        wait_until(lambda: httpx.get(f"{demo.grafana_url}/api/health", timeout=5).status_code == 200,
                   SCRAPE_TIMEOUT_S, "Grafana is healthy")
        found = httpx.get(f"{demo.grafana_url}/api/search", params={"query": "pdserve"}, timeout=5).json()
        assert any(d.get("title") == "pdserve" for d in found)


def dashboard_queries() -> list[str]:
    """The dashboard's PromQL with Grafana's rate interval and every model filled in, after checking
    that its data source is the compose file's Prometheus service."""
    provisioning = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    (source,) = yaml.safe_load(provisioning.read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", []) if "expr" in t]
    return [re.sub(r"\$__rate_interval|\$__interval", "1m", expr).replace("$model_name", ".*") for expr in exprs]


def test_a_decode_container_stopped_mid_stream_ends_the_stream_with_an_error_then_serves_again(
        demo: Demo, reference, docker_host: DockerHost):
    decode = demo.container("decode")
    body = {"prompt": PROMPTS[1], "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
    events: list[str] = []
    with httpx.stream("POST", f"{demo.url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 4:
                    docker_host.docker("stop", decode, timeout=120)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "error" in last, f"the stream ended without an error event: {events[-3:]}"
    assert last["error"]["code"] == 503
    tokens = [json.loads(e) for e in events[:-2]]
    assert 4 <= len(tokens) < 1000 and all("choices" in t for t in tokens)

    docker_host.docker("start", decode, timeout=120)
    answers: list[dict] = []

    def serves() -> bool:
        response = httpx.post(f"{demo.url}/v1/completions", timeout=60,
                              json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
        if response.status_code == 200:
            answers.append(response.json())
        return response.status_code == 200

    wait_until(serves, RESTART_TIMEOUT_S, "the router answers after the decode container restarts")
    assert answers[-1]["choices"][0]["text"] == reference[PROMPTS[0]]["choices"][0]["text"]


def test_batch1_tpot_of_the_demo_beside_the_host_server(demo: Demo, host_server: str, tmp_path):
    """One request at a time, the demo (router, prefill and decode containers) and `pdserve serve
    --aggregated` on the host take turns; the figures and their ratio are printed, not asserted."""
    demo_tpot, host_tpot = batch1_tpot(demo.url, host_server, tmp_path)
    print(f"batch-1 TPOT p50: compose demo {demo_tpot:.1f} ms, host {host_tpot:.1f} ms, "
          f"ratio {demo_tpot / host_tpot:.2f}")
    assert demo_tpot > 0 and host_tpot > 0


def test_compose_down_leaves_no_container_network_or_volume_and_the_daemon_stops_clean(
        demo: Demo, docker_host: DockerHost):
    demo.down()
    label = f"label=com.docker.compose.project={demo.project}"
    assert docker_host.docker("ps", "-aq", "--filter", label).stdout.split() == []
    assert docker_host.docker("network", "ls", "-q", "--filter", label).stdout.split() == []
    volumes = set(docker_host.docker("volume", "ls", "-q").stdout.decode().split())
    assert volumes <= demo.volumes_before, f"volumes left: {volumes - demo.volumes_before}"
    if docker_host.daemon is not None:  # the test's own daemon: it and its children end with it
        assert docker_host.stop() == []
