"""`RequireApiKey` over a raw ASGI app: 401 in the envelope, or on with the tenant."""
import asyncio
import json
from typing import Any

import pytest

from pdserve.router.openai.access.guard import RequireApiKey, tenant_of
from pdserve.common.api_keys import ApiKeys
from pdserve.router.openai.access.tenants import Tenant

KEYS = ApiKeys({"key-a": Tenant("acme"), "key-b": Tenant("bolt")})


class RecordingApp:
    """Answers 200 and records the tenant each request reached it with."""

    def __init__(self) -> None:
        self.tenants: list[Tenant | None] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.tenants.append(tenant_of(scope))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(app: RequireApiKey, path: str, authorization: str | None = None) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [] if authorization is None else [(b"authorization", authorization.encode("latin-1"))]
    asyncio.run(app({"type": "http", "method": "GET", "path": path, "headers": headers}, receive, send))
    response_headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], response_headers, b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/unknown", "/v1"])
@pytest.mark.parametrize("authorization, message", [
    (None, "missing API key"), ("Bearer wrong", "invalid API key"), ("Basic key-a", "missing API key"),
    ("Bearer ", "missing API key"), ("key-a", "missing API key"),
])
def test_v1_without_a_valid_key_is_401_in_the_envelope(path: str, authorization: str | None, message: str) -> None:
    inner = RecordingApp()
    status, headers, body = call(RequireApiKey(inner, KEYS), path, authorization)
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    error = json.loads(body)["error"]
    assert (error["type"], error["code"], error["param"]) == ("AuthenticationError", 401, None)
    assert error["message"].startswith(message)
    assert inner.tenants == []


def test_a_valid_key_passes_with_its_tenant() -> None:
    inner = RecordingApp()
    guarded = RequireApiKey(inner, KEYS)
    assert call(guarded, "/v1/models", "Bearer key-a")[0] == 200
    assert call(guarded, "/v1/completions", "bearer  key-b ")[0] == 200
    assert inner.tenants == ["acme", "bolt"]


def test_health_and_metrics_are_open_unless_metrics_is_protected() -> None:
    inner = RecordingApp()
    open_metrics = RequireApiKey(inner, KEYS)
    assert [call(open_metrics, p)[0] for p in ("/health", "/health/live", "/health/ready", "/metrics")] == [200] * 4
    protected = RequireApiKey(inner, KEYS, also={"/metrics"})
    assert (call(protected, "/metrics")[0], call(protected, "/metrics", "Bearer key-b")[0]) == (401, 200)
    assert call(protected, "/health")[0] == 200
    assert inner.tenants == [None] * 4 + ["bolt", None]
