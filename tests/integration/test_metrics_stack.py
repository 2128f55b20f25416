"""Scrapes of a running disaggregated stack (router, prefill and decode workers, real processes):
every vLLM model-server series is there under the served model name, each request is counted
once over the workers, and no counter of the router or of the decode worker drops while the
prefill worker leaves rotation and comes back."""
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.model.native import cpu_levels
from tests.integration.stack import free_port, make_tiny_checkpoint, start, stop, wait_for_http, wait_for_worker

pytestmark = pytest.mark.integration
MODEL = "tiny-metrics"
BLOCK = 16
PROMPT_LEN, MAX_TOKENS = 100, 4
VLLM_SERIES = (  # with model_name on a worker's --metrics-port
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
Samples = dict[tuple[str, frozenset], float]


class Stack:
    def __init__(self, directory: Path) -> None:
        checkpoint = str(make_tiny_checkpoint(directory / "tiny", hidden_size=128))  # head_dim 32: native kernels
        self.logs = directory
        self.common = ["--model", checkpoint, "--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32",
                       "--max-model-len", "512", "--max-kv-tokens", "4096", "--block-size", str(BLOCK),
                       "--num-threads", "1", "--log-level", "info"]
        self.ports = {role: (free_port(), free_port()) for role in ("prefill", "decode")}  # gRPC, metrics
        self.starts = 0
        self.workers = {role: self.start_worker(role) for role in self.ports}
        router_port = free_port()
        self.url = f"http://127.0.0.1:{router_port}"
        self.router = start(["router", "--model", checkpoint, "--served-model-name", MODEL, "--port", str(router_port),
                             "--worker-poll-interval", "0.2", "--worker", self.address("prefill"),
                             "--worker", self.address("decode")], directory / "router.log")
        wait_for_http(self.url, [self.router])

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.ports[role][0]}"

    def metrics_url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role][1]}/metrics"

    def start_worker(self, role: str):
        self.starts += 1
        grpc_port, metrics_port = self.ports[role]
        process = start(["worker", "--role", role, "--worker-id", f"{role}-0", "--port", str(grpc_port),
                         "--metrics-port", str(metrics_port), "--disagg-min-prefill-tokens", "1", *self.common],
                        self.logs / f"{role}-{self.starts}.log")
        wait_for_worker(self.address(role), process)
        return process

    def close(self) -> None:
        stop(self.router)
        for process in self.workers.values():
            stop(process)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("metrics"))
    try:
        yield stack
    finally:
        stack.close()


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and each family's type by sample name."""
    samples, types = {}, {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10.0).text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
            types[sample.name] = family.type
    return samples, types


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def complete(url: str, seed: int) -> str:
    """Where the request's prompt was computed: the prefill worker's address, or "local"."""
    prompt = [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(PROMPT_LEN)]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return dict(part.split("=", 1) for part in response.headers["x-pdserve-route"].split(";"))["prefilled_by"]


def worker_up(stack: Stack, role: str) -> float:
    return total(scrape(f"{stack.url}/metrics")[0], "pdserve_router_worker_up", worker=stack.address(role))


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def relayed_from(worker: str, key: tuple[str, frozenset]) -> bool:
    """A worker's own counter the router relays per worker: it restarts from zero with the worker."""
    name, labels = key
    return name.startswith("pdserve_router_worker_") and ("worker", worker) in labels


class MonotoneWatch:
    """Scrapes processes again and again; fails when a counter or histogram sample of one drops
    (but for the relayed counters of a worker that restarted)."""

    def __init__(self, urls: list[str], restarting: str) -> None:
        self.last = {url: scrape(url)[0] for url in urls}
        self.restarting = restarting

    def check(self) -> None:
        for url, before in self.last.items():
            now, types = scrape(url)
            dropped = {key: (before[key], value) for key, value in now.items()
                       if types[key[0]] in ("counter", "histogram") and key in before and value < before[key]
                       and not relayed_from(self.restarting, key)}
            assert not dropped, f"{url}: counters dropped: {dropped}"
            missing = [key for key in before if types.get(key[0]) in ("counter", "histogram") and key not in now]
            assert not missing, f"{url}: counters vanished: {missing}"
            self.last[url] = now


def test_every_vllm_series_is_exported_under_the_served_model_name_and_each_request_counted_once(stack) -> None:
    num_requests = 3
    remote = [complete(stack.url, seed) for seed in range(num_requests)].count(stack.address("prefill"))
    workers = {role: scrape(stack.metrics_url(role))[0] for role in stack.ports}
    for role, samples in workers.items():
        labelled = {name for (name, labels) in samples if ("model_name", MODEL) in labels and ("engine", "0") in labels}
        assert set(VLLM_SERIES) - labelled == set(), role
        (lora,) = [dict(labels) for (name, labels) in samples if name == "vllm:lora_requests_info"]
        assert set(lora) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
        kernels = {dict(labels)["kernels"]: v for (name, labels), v in samples.items() if name == "pdserve_cpu_kernels_info"}
        assert kernels == {cpu_levels()[-1] if cpu_levels() else "torch": 1.0}, role

    def summed(name: str, **labels: str) -> float:
        return sum(total(samples, name, model_name=MODEL, **labels) for samples in workers.values())

    # each request: prefilled once (on whichever worker the router chose), finished once
    assert summed("vllm:request_success_total", finished_reason="length") == num_requests
    assert summed("vllm:request_prefill_time_seconds_count") == num_requests
    assert summed("vllm:prompt_tokens_total") == num_requests * PROMPT_LEN
    assert summed("vllm:generation_tokens_total") == num_requests * MAX_TOKENS
    assert summed("vllm:time_to_first_token_seconds_count") == num_requests
    assert summed("vllm:inter_token_latency_seconds_count") == num_requests * (MAX_TOKENS - 1)
    assert total(workers["prefill"], "vllm:request_success_total") == 0  # it never finishes a request
    assert total(workers["prefill"], "vllm:request_prefill_time_seconds_count") == remote
    assert total(workers["decode"], "vllm:request_prefill_time_seconds_count") == num_requests - remote
    router = scrape(f"{stack.url}/metrics")[0]
    assert not [name for (name, _) in router if name.startswith("vllm:")]  # no worker figure twice
    assert total(router, "pdserve_e2e_request_latency_seconds_count") == num_requests


def test_counters_stay_monotone_while_the_prefill_worker_leaves_rotation_and_rejoins(stack) -> None:
    watch = MonotoneWatch([f"{stack.url}/metrics", stack.metrics_url("decode")], stack.address("prefill"))
    prefilled_by = [complete(stack.url, seed) for seed in range(10, 14)]
    assert stack.address("prefill") in prefilled_by  # the worker leaving had figures of its own
    watch.check()
    stop(stack.workers["prefill"])
    wait_until(lambda: worker_up(stack, "prefill") == 0, 30.0, "the stopped prefill worker stayed in rotation")
    for seed in (14, 15):  # prefilled on the decode worker meanwhile
        assert complete(stack.url, seed) == "local"
        watch.check()
    stack.workers["prefill"] = stack.start_worker("prefill")
    wait_until(lambda: worker_up(stack, "prefill") == 1, 60.0, "the restarted prefill worker did not rejoin")
    watch.check()
    remote = [complete(stack.url, seed) for seed in (16, 17)].count(stack.address("prefill"))
    watch.check()
    restarted = scrape(stack.metrics_url("prefill"))[0]  # its own counters, from zero at its start
    assert total(restarted, "vllm:request_prefill_time_seconds_count", model_name=MODEL) == remote
