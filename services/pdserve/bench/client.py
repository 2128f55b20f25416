"""Streaming HTTP to an OpenAI-compatible server: one request in, one measurement out.

Speaks HTTP only. Every request streams (SSE) with `stream_options.include_usage`, so
token counts come from the server's `usage` when it sends one.
"""
import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from pdserve.common.errors import PdserveError

MAX_ERROR_CHARS = 300


class EndpointError(PdserveError):
    """The server cannot be used at all (unreachable, or `/v1/models` is unusable)."""


@dataclass(frozen=True, slots=True)
class StreamResult:
    """One streamed response. Times are seconds after the request was sent.

    `error is None` implies at least one token chunk arrived.
    """

    chunk_times: tuple[float, ...]
    finish_time: float
    text: str
    prompt_tokens: int | None  # from the server's usage, when sent
    completion_tokens: int | None
    error: str | None


def _chunk_text(event: dict) -> str:
    """Text carried by a completions (`text`) or chat (`delta.content`) chunk."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def _error_text(payload: object) -> str:
    """The message of an OpenAI-style error body, or the body itself, shortened."""
    if isinstance(payload, dict) and "error" in payload:
        error = payload["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return str(message)[:MAX_ERROR_CHARS]
    return str(payload)[:MAX_ERROR_CHARS]


class _Stream:
    """Accumulates SSE events of one response."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.chunk_times: list[float] = []
        self.pieces: list[str] = []
        self.usage: dict = {}
        self.error: str | None = None

    def feed(self, line: str) -> bool:
        """Consume one SSE line; False once the stream is over ([DONE] or an error)."""
        if not line.startswith("data:"):
            return True  # blank separators, comments, `event:` lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return False
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"malformed SSE data: {data[:80]!r}"
            return False
        if not isinstance(event, dict) or "error" in event:
            self.error = f"error event: {_error_text(event)}"
            return False
        if text := _chunk_text(event):
            self.chunk_times.append(time.perf_counter() - self.sent_at)
            self.pieces.append(text)
        self.usage = event.get("usage") or self.usage
        return True

    def result(self, error: str | None) -> StreamResult:
        error = error or self.error
        if error is None and not self.chunk_times:
            error = "stream ended without a token"
        return StreamResult(
            chunk_times=tuple(self.chunk_times),
            finish_time=time.perf_counter() - self.sent_at,
            text="".join(self.pieces),
            prompt_tokens=self.usage.get("prompt_tokens"),
            completion_tokens=self.usage.get("completion_tokens"),
            error=error,
        )


async def stream_request(
    http: httpx.AsyncClient, url: str, payload: dict, timeout_s: float | None = None
) -> StreamResult:
    """POST `payload` to `url` and read the SSE stream to its end, within `timeout_s` overall.

    Never raises for a failed request: HTTP errors, error events (also inside an HTTP 200
    stream), transport errors and timeouts become `StreamResult.error`.
    """
    stream = _Stream(time.perf_counter())
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(http, url, payload, stream)
    except TimeoutError:
        return stream.result(f"timed out after {timeout_s:g} s")
    except httpx.HTTPError as exc:
        return stream.result(f"{type(exc).__name__}: {exc}".rstrip(": ")[:MAX_ERROR_CHARS])


async def _read(http: httpx.AsyncClient, url: str, payload: dict, stream: _Stream) -> StreamResult:
    async with http.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace")
            return stream.result(f"HTTP {response.status_code}: {_error_body(body)}")
        async for line in response.aiter_lines():
            if not stream.feed(line):
                break
    return stream.result(None)


def _error_body(body: str) -> str:
    try:
        return _error_text(json.loads(body))
    except json.JSONDecodeError:
        return body[:MAX_ERROR_CHARS]


async def fetch_model_ids(http: httpx.AsyncClient, base_url: str) -> list[str]:
    """Ids listed by `GET {base_url}/v1/models`; raises EndpointError when unusable."""
    url = f"{base_url}/v1/models"
    try:
        response = await http.get(url)
    except httpx.HTTPError as exc:
        raise EndpointError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise EndpointError(f"{url} answered HTTP {response.status_code}")
    try:
        return [entry["id"] for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(f"{url} did not return an OpenAI model list") from None
