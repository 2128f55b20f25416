"""Request migration across real processes: a decode worker killed mid-stream, its request
continued on the other decode worker from the tokens already streamed; the client's stream is
whole and token-identical to an uninterrupted greedy run, and the router counts the migration."""
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.stack import make_tiny_checkpoint, metric, routed_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ROLES = ("prefill", "decode", "decode")
PROMPT = [(i * 7919) % 4000 + 100 for i in range(40)]
MAX_TOKENS = 300
KILL_AFTER_CHUNKS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    with routed_cluster(checkpoint, tmp_path_factory.mktemp("logs"), ROLES, ["--disagg-min-prefill-tokens", "1"],
                        ["--migration-limit", "2"]) as (url, workers):
        yield {"url": url, "workers": workers}


def body(stream: bool) -> dict[str, object]:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 0}


def test_a_decode_worker_killed_mid_stream_leaves_the_answer_whole(cluster) -> None:
    url = cluster["url"]
    reference = httpx.post(f"{url}/v1/completions", json=body(False), timeout=120).json()["choices"][0]
    expected_text, expected_tokens = reference["text"], reference["logprobs"]["tokens"]
    assert len(expected_tokens) == MAX_TOKENS
    text, tokens, finish_reason, killed = [], [], None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body(True), timeout=120) as response:
        assert response.status_code == 200
        decode_worker = dict(p.split("=") for p in response.headers["x-pdserve-route"].split(";"))["decode"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            (choice,) = chunk["choices"]
            text.append(choice["text"])
            tokens += choice["logprobs"]["tokens"]
            finish_reason = choice["finish_reason"] or finish_reason
            if len(text) == KILL_AFTER_CHUNKS:
                killed = cluster["workers"][decode_worker]
                os.kill(killed.pid, signal.SIGKILL)
    assert killed is not None and killed.wait(10) == -signal.SIGKILL
    assert (tokens, "".join(text), finish_reason) == (expected_tokens, expected_text, "length")
    assert metric(f"{url}/metrics", "pdserve_router_migrations_total", f'worker="{decode_worker}"') == 1
    cluster["killed"] = decode_worker


def test_the_router_serves_on_after_the_migration(cluster) -> None:
    killed = cluster["killed"]
    up = f'role="decode",worker="{killed}"'
    deadline = time.monotonic() + 30
    while metric(f"{cluster['url']}/metrics", "pdserve_router_worker_up", up) != 0:
        assert time.monotonic() < deadline, "the killed decode worker stayed in rotation"
        time.sleep(0.2)
    for _ in range(3):
        response = httpx.post(f"{cluster['url']}/v1/completions", json={**body(False), "max_tokens": 4}, timeout=60)
        assert response.status_code == 200, response.text
