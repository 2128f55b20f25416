"""Slow clients hold no admission slot: 1,100 connections that send their body a byte at a time
(more than `--max-pending-requests`) while a normal request is answered; a body not in within
its timeout is a 408; a body over the limit is read to its end and answered 413, not reset. A
client that stops reading its answer is cut off and its slot freed (over a raw ASGI app)."""
import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge

from http_fakes import MODEL_NAME, word_server
from pdserve.router.openai.admission import PendingLimit
from pdserve.router.openai.serving import ApiLimits

pytestmark = pytest.mark.integration
BODY = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 3, "temperature": 0}
LIMITS = ApiLimits(max_pending_requests=1024, body_timeout_s=3.0, max_body_bytes=1 << 20)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with word_server(tmp_path_factory.getbasetemp(), limits=LIMITS) as (base, _):
        yield base


def slow_connection(url: str) -> socket.socket:
    """Headers of a 100-byte completion body, then its first byte: the rest never comes."""
    address = urlparse(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{")
    return sock


def test_slow_bodies_past_the_admission_bound_hold_no_slot(url: str) -> None:
    sockets = [slow_connection(url) for _ in range(1100)]
    try:
        time.sleep(0.5)
        answer = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
        assert answer.status_code == 200, answer.text
    finally:
        for sock in sockets:
            sock.close()


def test_a_body_not_in_within_its_timeout_is_408(url: str) -> None:
    sock = slow_connection(url)
    try:
        sock.settimeout(LIMITS.body_timeout_s + 10)
        reply = b""
        while chunk := sock.recv(4096):  # the answer closes the connection
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"was not sent within 3 s" in reply
    finally:
        sock.close()


def test_a_body_over_the_limit_is_answered_413_not_reset(url: str) -> None:
    body = b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
    answer = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                        timeout=30)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == 413


def test_a_client_that_stops_reading_is_cut_off_and_frees_its_slot() -> None:
    async def streaming_app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(1000):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})

    async def scenario() -> None:
        gauge = Gauge("in_progress", "requests in progress", registry=CollectorRegistry())
        limit = PendingLimit(streaming_app, 4, {"/v1/completions"}, gauge, send_timeout_s=0.2)
        taken: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def stalled_send(message: dict) -> None:  # the client took the status line, then stopped reading
            if taken:
                await asyncio.Event().wait()
            taken.append(message)

        await asyncio.wait_for(limit({"type": "http", "path": "/v1/completions", "headers": []}, receive,
                                     stalled_send), 10)
        assert limit.num_pending == 0 and len(taken) == 1

    asyncio.run(scenario())
