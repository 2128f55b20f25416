"""Two router replicas in front of the same two aggregated workers, as behind one load balancer:
each keeps its own prefix index from the workers' KV event streams, so a long prompt one router
sent to a worker is routed to that same worker by the other router, which reports the hit (its
route header's overlap, the worker's cached tokens in usage) without ever having seen the prompt."""
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.stack import free_port, make_tiny_checkpoint, start, stop, wait_for_http, wait_for_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BLOCK = 16
NUM_BLOCKS = 10


def prompt(seed: int) -> list[int]:
    """NUM_BLOCKS full blocks and one token more (a full hit still computes the last token)."""
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(NUM_BLOCKS * BLOCK + 1)]


@pytest.fixture(scope="module")
def routers(tmp_path_factory) -> Iterator[dict]:
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
              "--max-kv-tokens", "4096", "--block-size", str(BLOCK), "--num-threads", "1"]
    workers = {}
    for i in range(2):
        port = free_port()
        workers[f"127.0.0.1:{port}"] = start(["worker", "--role", "both", "--port", str(port), *common],
                                             logs / f"worker-{i}.log")
    routers: dict[str, str] = {}
    processes = []
    try:
        for address, process in workers.items():
            wait_for_worker(address, process)
        for name in ("a", "b"):
            port = free_port()
            processes.append(start(["router", "--model", checkpoint, "--port", str(port), "--worker-poll-interval",
                                    "0.2", *[arg for address in workers for arg in ("--worker", address)]],
                                   logs / f"router-{name}.log"))
            routers[name] = f"http://127.0.0.1:{port}"
        for url in routers.values():
            wait_for_http(url, processes)
        yield {"routers": routers, "workers": list(workers)}
    finally:
        for process in [*processes, *workers.values()]:
            stop(process)


def complete(url: str, tokens: list[int]) -> httpx.Response:
    body = {"prompt": tokens, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return response


def route(response: httpx.Response) -> dict[str, str]:
    return dict(part.split("=") for part in response.headers["x-pdserve-route"].split(";"))


def index_blocks(url: str, worker: str) -> float:
    """The router's own index: blocks it holds for `worker`."""
    for line in httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(f'pdserve_router_index_blocks{{worker="{worker}"}} '):
            return float(line.split()[-1])
    return 0.0


def reported_requests(url: str, worker: str) -> float | None:
    """Running + waiting requests of `worker` as the router at `url` last heard them."""
    for line in httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(f'pdserve_router_worker_requests{{worker="{worker}"}} '):
            return float(line.split()[-1])
    return None


def wait_for_idle_report(url: str, worker: str, timeout_s: float = 15.0) -> None:
    """Until the router's last report of `worker` shows no request: one taken while the first
    request ran makes the holder look busy, and the load can outweigh the hit."""
    deadline = time.monotonic() + timeout_s
    while reported_requests(url, worker) != 0:
        assert time.monotonic() < deadline, f"{url} never heard {worker} idle"
        time.sleep(0.1)


def wait_for_index(url: str, worker: str, num_blocks: float, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while index_blocks(url, worker) < num_blocks:
        assert time.monotonic() < deadline, f"{url}'s index never held {num_blocks} blocks of {worker}"
        time.sleep(0.1)


@pytest.mark.parametrize("first, second, seed", [("a", "b", 1), ("b", "a", 2), ("a", "b", 3), ("b", "a", 4)])
def test_a_prompt_cached_through_one_router_is_a_hit_through_the_other(routers, first, second, seed) -> None:
    urls, tokens = routers["routers"], prompt(seed)
    before = {worker: index_blocks(urls[second], worker) for worker in routers["workers"]}
    cold = complete(urls[first], tokens)
    holder = route(cold)["decode"]
    assert route(cold)["decode_overlap"] == "0"
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for_index(urls[second], holder, before[holder] + NUM_BLOCKS)  # from the worker's events alone
    wait_for_idle_report(urls[second], holder)

    warm = complete(urls[second], tokens)
    assert route(warm)["decode"] == holder
    assert route(warm)["decode_overlap"] == str(NUM_BLOCKS)
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == NUM_BLOCKS * BLOCK
    assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
