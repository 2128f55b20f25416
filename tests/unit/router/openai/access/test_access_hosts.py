"""`RequireAllowedHost` over a raw ASGI app, and which hosts a listen address allows by default."""
import asyncio
import json
from typing import Any

import pytest

from pdserve.router.openai.access.hosts import LOOPBACK_NAMES, RequireAllowedHost, allowed_hosts


class CountingApp:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.calls += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(app: RequireAllowedHost, host: str | None) -> tuple[int, bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [] if host is None else [(b"host", host.encode("latin-1"))]
    asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("listen, configured, expected", [
    ("127.0.0.1", (), LOOPBACK_NAMES),
    ("localhost", (), LOOPBACK_NAMES),
    ("::1", (), LOOPBACK_NAMES),
    ("127.0.0.2", (), LOOPBACK_NAMES | {"127.0.0.2"}),
    ("0.0.0.0", (), None),
    ("10.1.2.3", (), None),
    ("127.0.0.1", ("Api.Example.com", "localhost"), {"api.example.com", "localhost"}),
    ("127.0.0.1", ("*",), None),
    ("0.0.0.0", ("router.internal",), {"router.internal"}),
])
def test_a_loopback_server_allows_only_loopback_names_unless_told(listen, configured, expected) -> None:
    assert allowed_hosts(listen, configured) == expected


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST", "localhost.", "::1"])
def test_loopback_hosts_reach_the_app(host: str) -> None:
    app = CountingApp()
    assert call(RequireAllowedHost(app, LOOPBACK_NAMES), host)[0] == 200
    assert app.calls == 1


@pytest.mark.parametrize("host", ["attacker.example:8000", "attacker.example", "127.0.0.1.attacker.example", "",
                                  None, "localhost:8000@evil", "[::2]:8000"])
def test_another_host_is_refused_in_the_envelope_before_the_app_runs(host: str | None) -> None:
    app = CountingApp()
    status, body = call(RequireAllowedHost(app, LOOPBACK_NAMES), host)
    assert status == 400 and app.calls == 0
    error = json.loads(body)["error"]
    assert error["type"] == "BadRequestError" and "is not served here" in error["message"]
