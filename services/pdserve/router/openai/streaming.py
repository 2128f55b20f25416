"""Server-sent events: framing, the error frame, and a response that stops on disconnect.

A stream's status line is sent only once its first event is in hand (`prefetch`), so a
request the backend refuses or never answers still gets a plain error status. After that,
a failure is reported in-band: one `data: {"error": {...}}` frame, then `data: [DONE]`.
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
_CLOSE_TIMEOUT_S = 5.0
_log = logging.getLogger(__name__)
T = TypeVar("T")


def sse_frame(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


async def prefetch(events: AsyncIterator[T]) -> tuple[T, AsyncIterator[T]]:
    """The first event and an iterator of all of them (that first one included).

    Raises whatever the first wait raises; `events` is closed in that case.
    """
    try:
        first = await anext(events)
    except BaseException:
        await _aclose(events)
        raise

    async def replay() -> AsyncGenerator[T, None]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await _aclose(events)

    return first, replay()


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

    def __init__(self, frames: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(with_error_frame(frames), headers=headers)

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


async def _aclose(iterator: AsyncIterator[object]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await asyncio.wait_for(aclose(), _CLOSE_TIMEOUT_S)
