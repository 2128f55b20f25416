"""`PendingLimit` over a raw ASGI app: past the bound a generation request is refused at once."""
import asyncio
import json
from collections.abc import Coroutine
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from pdserve.router.openai.admission import PendingLimit

WAIT_S = 10.0
GENERATION = "/v1/completions"


class HeldApp:
    """Answers 200 once `release` is set; counts the requests it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.num_seen = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.num_seen += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(app: PendingLimit, path: str) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def limited(app: HeldApp, max_pending: int) -> tuple[PendingLimit, CollectorRegistry]:
    registry = CollectorRegistry()
    gauge = Gauge("in_progress", "generation requests in progress", registry=registry)
    return PendingLimit(app, max_pending, {GENERATION}, gauge), registry


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


def test_past_the_bound_a_generation_request_gets_503_with_retry_after_and_the_envelope() -> None:
    async def scenario() -> None:
        inner = HeldApp()
        limit, registry = limited(inner, max_pending=2)
        admitted = [asyncio.create_task(call(limit, GENERATION)) for _ in range(2)]
        while inner.num_seen < 2:
            await asyncio.sleep(0.001)
        status, headers, body = await asyncio.wait_for(call(limit, GENERATION), WAIT_S)
        assert (status, headers["retry-after"]) == (503, "1")
        assert json.loads(body) == {"error": {
            "message": "2 requests in progress (--max-pending-requests 2); retry later",
            "type": "ServiceUnavailableError", "param": None, "code": 503}}
        assert (inner.num_seen, limit.num_pending, registry.get_sample_value("in_progress")) == (2, 2, 2.0)
        inner.release.set()
        assert [(await task)[0] for task in admitted] == [200, 200]
        assert (limit.num_pending, registry.get_sample_value("in_progress")) == (0, 0.0)
        assert (await call(limit, GENERATION))[0] == 200

    run(scenario())


def test_other_routes_are_never_refused_or_counted() -> None:
    async def scenario() -> None:
        inner = HeldApp()
        limit, _ = limited(inner, max_pending=1)
        held = asyncio.create_task(call(limit, GENERATION))
        while inner.num_seen < 1:
            await asyncio.sleep(0.001)
        health = asyncio.create_task(call(limit, "/health/ready"))
        while inner.num_seen < 2:
            await asyncio.sleep(0.001)
        assert limit.num_pending == 1
        inner.release.set()
        assert [(await task)[0] for task in (held, health)] == [200, 200]

    run(scenario())
