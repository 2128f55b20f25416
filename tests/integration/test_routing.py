"""KV-aware routing across real processes: 2 prefill and 2 decode workers (KV over NIXL) behind
one `pdserve router`. Requests sharing a long prefix land on the workers holding it (read back
from the router's routing metrics); another tenant's salt never attracts; a prefill and a
decode worker killed mid-run are dropped, and later requests do not fail."""
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.stack import make_tiny_checkpoint, routed_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
BLOCK = 16
PREFIX = [(i * 104729) % 40000 + 100 for i in range(10 * BLOCK)]  # 10 full blocks
ROLES = ("prefill", "prefill", "decode", "decode")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    worker_args = ["--block-size", str(BLOCK), "--log-level", "info", "--disagg-min-prefill-tokens", "1"]
    with routed_cluster(checkpoint, tmp_path_factory.mktemp("logs"), ROLES, worker_args) as (url, workers):
        yield {"url": url, "workers": workers, "prefill": list(workers)[:2], "decode": list(workers)[2:]}


def complete(url: str, prompt: list[int], salt: str | None = None) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    return response


def route(response: httpx.Response) -> dict[str, str]:
    return dict(part.split("=") for part in response.headers["x-pdserve-route"].split(";"))


def routing_metrics(url: str) -> dict[str, float]:
    """Samples of the router's `pdserve_router_*` series, keyed by name and labels."""
    lines = httpx.get(f"{url}/metrics", timeout=5.0).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith("pdserve_router_")}


def index_blocks(url: str, worker: str) -> float:
    return routing_metrics(url).get(f'pdserve_router_index_blocks{{worker="{worker}"}}', 0.0)


def wait_for_index(url: str, worker: str, num_blocks: float, timeout_s: float = 10.0) -> None:
    """Until the router's index holds at least `num_blocks` blocks of `worker`."""
    deadline = time.monotonic() + timeout_s
    while index_blocks(url, worker) < num_blocks:
        assert time.monotonic() < deadline, f"the index never held {num_blocks} blocks of {worker}"
        time.sleep(0.1)


def test_requests_sharing_a_prefix_land_on_the_workers_holding_it(cluster) -> None:
    url = cluster["url"]
    first = route(complete(url, PREFIX + [7] * 9))
    wait_for_index(url, first["prefill"], 10)
    wait_for_index(url, first["decode"], 10)
    later = [route(complete(url, PREFIX + [11 + i] * 9)) for i in range(4)]
    assert {(r["prefill"], r["decode"]) for r in later} == {(first["prefill"], first["decode"])}
    assert [(r["prefill_overlap"], r["decode_overlap"]) for r in later] == [("10", "10")] * 4
    seen = routing_metrics(url)
    for role in ("prefill", "decode"):
        labels = f'role="{role}",worker="{first[role]}"'
        assert seen[f"pdserve_router_routed_requests_total{{{labels}}}"] == 5
        assert seen[f"pdserve_router_routed_overlap_blocks_total{{{labels}}}"] == 4 * 10
        assert seen[f"pdserve_router_routed_prompt_blocks_total{{{labels}}}"] == 5 * 11


def test_another_tenants_salt_does_not_attract_its_requests(cluster) -> None:
    url = cluster["url"]
    held = {worker: index_blocks(url, worker) for worker in cluster["workers"]}
    mine = route(complete(url, PREFIX + [21] * 9, salt="tenant-a"))
    wait_for_index(url, mine["prefill"], held[mine["prefill"]] + 10)
    again = route(complete(url, PREFIX + [22] * 9, salt="tenant-a"))
    theirs = route(complete(url, PREFIX + [23] * 9, salt="tenant-b"))
    assert (again["prefill_overlap"], theirs["prefill_overlap"], theirs["decode_overlap"]) == ("10", "0", "0")


def test_workers_killed_mid_run_are_dropped_and_later_requests_succeed(cluster) -> None:
    url, workers = cluster["url"], cluster["workers"]
    holder = route(complete(url, PREFIX + [31] * 9))
    dead = {holder["prefill"]: "prefill", holder["decode"]: "decode"}
    for address in dead:
        workers[address].send_signal(signal.SIGKILL)
    for i in range(4):  # at once, before the router may have noticed: none may fail
        complete(url, PREFIX + [41 + i] * 9)
    deadline = time.monotonic() + 10.0
    while any(routing_metrics(url)[f'pdserve_router_worker_up{{role="{role}",worker="{address}"}}']
              for address, role in dead.items()):
        assert time.monotonic() < deadline, "the router kept a killed worker in rotation"
        time.sleep(0.1)
    later = [route(complete(url, PREFIX + [51 + i] * 9)) for i in range(3)]
    assert {(r["prefill"], r["decode"]) for r in later} == {
        (next(iter(set(cluster["prefill"]) - dead.keys())), next(iter(set(cluster["decode"]) - dead.keys())))}
    seen = routing_metrics(url)
    assert [seen[f'pdserve_router_index_blocks{{worker="{address}"}}'] for address in dead] == [0, 0]
