"""Overload and wedge with real processes: one router and one role-both worker on loopback,
whose engine steps can be held (`stalling_worker.py`) so requests stay in progress.

(a) past the router's --max-pending-requests, (b) past the worker's --max-waiting-requests, a
request gets 503 with OpenAI's envelope and Retry-After while the admitted ones are still held,
and those complete once released; (c) a worker whose engine finishes no step within
--engine-step-timeout answers health NOT_SERVING, the router's readiness 503 names why while its
liveness stays 200, and both recover when the engine moves again. After each, the worker's KV
bookkeeping holds and its blocks in use are back at baseline.
"""
import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc
from pdserve.rpc.worker_client import GrpcBackend
from tests.integration.stack import (
    free_port,
    make_tiny_checkpoint,
    metric,
    start,
    stop,
    wait_for_http,
    wait_for_worker,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # bound on every wait for something to happen
BODY = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@dataclass
class Stack:
    url: str
    worker: str  # its gRPC address
    stall: Path  # while this file exists, the worker's engine steps wait


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@contextmanager
def stack(checkpoint: str, logs: Path, worker_flags: list[str], router_flags: list[str]) -> Iterator[Stack]:
    stall = logs / "stall"
    worker_port, router_port = free_port(), free_port()
    address, url = f"127.0.0.1:{worker_port}", f"http://127.0.0.1:{router_port}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.stalling_worker", str(stall), "--role", "both", "--port",
         str(worker_port), "--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
         "--max-kv-tokens", "4096", "--block-size", "16", "--num-threads", "1", "--insecure-internal", *worker_flags],
        cwd=REPO, stdout=open(logs / "worker.log", "wb"), stderr=subprocess.STDOUT)
    router = None
    try:
        wait_for_worker(address, worker)
        router = start(["router", "--model", checkpoint, "--port", str(router_port), "--worker", address,
                        "--worker-poll-interval", "0.2", *router_flags], logs / "router.log")
        wait_for_http(url, [router])
        yield Stack(url, address, stall)
    finally:
        stall.unlink(missing_ok=True)
        if router is not None:
            stop(router)
        stop(worker)


def post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, timeout=WAIT_S)


def first_answers(futures: list[Future], count: int) -> tuple[list[httpx.Response], list[Future]]:
    """The first `count` responses to come back, and the futures still waiting."""
    deadline = time.monotonic() + WAIT_S
    pending = set(futures)
    while len(futures) - len(pending) < count:
        assert time.monotonic() < deadline, f"fewer than {count} answers within {WAIT_S} s"
        _, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
    return [f.result() for f in futures if f not in pending], [f for f in futures if f in pending]


def assert_overloaded(response: httpx.Response, names: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("ServiceUnavailableError", 503, None)
    assert names in error["message"]


def used_blocks(address: str) -> tuple[bool, int]:
    async def ask() -> tuple[bool, int]:
        backend = GrpcBackend(address)
        try:
            report = await backend.check_integrity()
            return report.ok, report.num_used_blocks
        finally:
            await backend.close()

    return asyncio.run(ask())


def settled(address: str, baseline: int) -> tuple[bool, int]:
    """The worker's integrity and blocks in use, once back at `baseline` (or after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while (report := used_blocks(address))[1] > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    return report


def health(address: str) -> tuple[int, str]:
    with grpc.insecure_channel(address) as channel:
        reply = worker_pb2_grpc.WorkerStub(channel).Health(wpb.HealthRequest(), timeout=5.0)
    return reply.status, reply.reason


def eventually(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.1)


def test_requests_past_the_routers_bound_get_503_at_once_and_the_admitted_complete(checkpoint, tmp_path) -> None:
    with stack(checkpoint, tmp_path, [], ["--max-pending-requests", "2"]) as s, ThreadPoolExecutor(5) as pool:
        assert post(s.url).status_code == 200  # warm: the prompt's blocks are cached from here on
        baseline = settled(s.worker, 0)
        s.stall.touch()
        futures = [pool.submit(post, s.url) for _ in range(5)]
        refused, held = first_answers(futures, 3)
        for response in refused:
            assert_overloaded(response, "2 requests in progress (--max-pending-requests 2)")
        assert (len(held), s.stall.exists()) == (2, True)  # admitted, and still held by the engine
        assert metric(f"{s.url}/metrics", "pdserve_http_requests_in_progress") == 2
        s.stall.unlink()
        assert [f.result(WAIT_S).status_code for f in held] == [200, 200]
        assert settled(s.worker, baseline[1]) == baseline
        assert metric(f"{s.url}/metrics", "pdserve_http_requests_in_progress") == 0


def test_a_request_past_the_workers_bound_gets_resource_exhausted_as_503(checkpoint, tmp_path) -> None:
    with stack(checkpoint, tmp_path, ["--max-waiting-requests", "1"], []) as s, ThreadPoolExecutor(2) as pool:
        assert post(s.url).status_code == 200
        baseline = settled(s.worker, 0)
        s.stall.touch()
        futures = [pool.submit(post, s.url) for _ in range(2)]
        (refused,), (held,) = first_answers(futures, 1)
        assert_overloaded(refused, "overloaded: 1 requests are waiting for their first token "
                                   "(--max-waiting-requests 1)")
        s.stall.unlink()
        assert held.result(WAIT_S).status_code == 200
        assert settled(s.worker, baseline[1]) == baseline


def test_a_wedged_worker_is_not_ready_until_its_engine_moves_again(checkpoint, tmp_path) -> None:
    with stack(checkpoint, tmp_path, ["--engine-step-timeout", "2"], []) as s, ThreadPoolExecutor(1) as pool:
        assert post(s.url).status_code == 200
        baseline = settled(s.worker, 0)
        eventually("the router is ready", lambda: httpx.get(f"{s.url}/health/ready", timeout=5.0).status_code == 200)
        s.stall.touch()
        queued = pool.submit(post, s.url)  # its step waits: work queued, no step finishes
        eventually("the worker answers NOT_SERVING", lambda: health(s.worker)[0] == wpb.SERVING_STATUS_NOT_SERVING)
        assert health(s.worker)[1].startswith("engine wedged: its thread has not finished a step for ")
        eventually("the router is not ready",
                   lambda: httpx.get(f"{s.url}/health/ready", timeout=5.0).status_code == 503)
        ready = httpx.get(f"{s.url}/health/ready", timeout=5.0)
        assert "engine wedged" in ready.json()["error"]["message"], ready.text
        assert httpx.get(f"{s.url}/health", timeout=5.0).status_code == 503
        assert httpx.get(f"{s.url}/health/live", timeout=5.0).status_code == 200
        assert_overloaded(post(s.url), "no decode or aggregated worker is up")  # refused, never queued
        assert not queued.done()
        s.stall.unlink()
        assert queued.result(WAIT_S).status_code == 200
        eventually("the worker serves again", lambda: health(s.worker) == (wpb.SERVING_STATUS_SERVING, ""))
        eventually("the router is ready again",
                   lambda: httpx.get(f"{s.url}/health/ready", timeout=5.0).status_code == 200)
        assert post(s.url).status_code == 200
        assert settled(s.worker, baseline[1]) == baseline
