"""Server-sent events: framing, the error frame, keep-alives, and a response that stops on disconnect.

A stream's status line waits for its first event (`prefetch`), so a request the backend
refuses at once still gets a plain error status. A first event that takes longer than the
keep-alive interval (a queued request, a long prefill) no longer holds the status line back:
the stream starts, and an SSE comment (`: keep-alive`) goes out each interval without an
event, so proxies with idle timeouts keep the connection. After the status line, a failure
is reported in-band: one `data: {"error": {...}}` frame, then `data: [DONE]`.
"""
import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router.openai.errors import from_exception

DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
_CLOSE_TIMEOUT_S = 5.0
_log = logging.getLogger(__name__)
T = TypeVar("T")


def sse_frame(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


async def prefetch(events: AsyncIterator[T], patience_s: float | None = None) -> AsyncIterator[T]:
    """An iterator of all of `events` once the first is in hand or `patience_s` has passed.

    Raises whatever the first wait raises within `patience_s`; `events` is closed in that case.
    """
    first = asyncio.ensure_future(anext(events))
    try:
        await asyncio.wait({first}, timeout=patience_s)
        if first.done():
            first.result()  # raises a refusal now, while a plain error status can still answer it
    except BaseException:
        await _cancel(first)
        await _aclose(events)
        raise

    async def replay() -> AsyncGenerator[T, None]:
        try:
            try:
                yield await first
            except StopAsyncIteration:
                return
            async for event in events:
                yield event
        finally:
            await _cancel(first)
            await _aclose(events)

    return replay()


async def with_keepalive(frames: AsyncGenerator[bytes, None], interval_s: float | None) -> AsyncGenerator[bytes, None]:
    """`frames`, with a keep-alive comment after each `interval_s` that passes without one."""
    if not interval_s:
        async for frame in frames:
            yield frame
        return
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(frames))
            await asyncio.wait({pending}, timeout=interval_s)
            if not pending.done():
                yield KEEPALIVE_FRAME
                continue
            done, pending = pending, None
            try:
                frame = done.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if pending is not None:
            await _cancel(pending)
        await frames.aclose()


async def with_error_frame(frames: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """`frames`, then `[DONE]`; a failure midway becomes an error frame before `[DONE]`."""
    try:
        async for frame in frames:
            yield frame
    except Exception as exc:  # reported to the client in-band; the status line is long gone
        error = from_exception(exc)
        if error.status >= 500:
            _log.warning("stream failed after it started: %s", error.message)
        yield b"data: " + json.dumps(error.to_body()).encode() + b"\n\n"
    finally:
        await frames.aclose()
    yield DONE_FRAME


class SseResponse(StreamingResponse):
    """An event stream that is cancelled as soon as the client disconnects, whatever the
    server's ASGI version, and whose generator is always closed (closing backend streams)."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncGenerator[bytes, None], keepalive_s: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(with_error_frame(with_keepalive(frames, keepalive_s)), headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.create_task(self.stream_response(send))
        watcher = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.wait({streamer, watcher}, timeout=_CLOSE_TIMEOUT_S)
            await _aclose(self.body_iterator)
        failure = streamer.exception() if streamer.done() and not streamer.cancelled() else None
        if failure is not None:
            raise failure


async def _cancel(task: asyncio.Future[object]) -> None:
    if not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=_CLOSE_TIMEOUT_S)
    elif not task.cancelled():
        task.exception()  # retrieved: an unawaited failure is not logged as lost


async def _aclose(iterator: AsyncIterator[object]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await asyncio.wait_for(aclose(), _CLOSE_TIMEOUT_S)
