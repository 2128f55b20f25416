"""`PendingLimit`: the router's bound on generation requests in progress, and on how long a
client may take to send a body or to read an answer.

At most `max_pending` generation requests are in progress at once, a streamed one until its
last byte is sent; one more is answered at once with 503, OpenAI's error envelope and
`Retry-After`, never queued. Every other route (health, metrics, models) is never refused.

A slot is taken only once the whole body is in: a client that sends its body slowly holds a
connection, not a slot, and one that has not sent it within `body_timeout_s` gets 408. A body
over `max_body_bytes` is read to its end (up to `DRAIN_BYTES`, within the same timeout) and
answered 413, so the client reads the answer instead of a reset. Every write of an answer must
be taken by the client within `send_timeout_s`: a client that stops reading a stream is cut
off, and its request aborted, instead of keeping its slot for ever.
"""
import asyncio
import logging
from collections.abc import Collection

from prometheus_client import Gauge
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.openai.deadline import Deadline
from pdserve.router.openai.errors import ApiError, overloaded

DRAIN_BYTES = 64 << 20  # of a body over the limit, read and dropped so the 413 is read, not reset
_log = logging.getLogger(__name__)


class _ClientStalled(Exception):
    """The client took no byte of the answer within the send timeout."""


class PendingLimit:
    def __init__(self, app: ASGIApp, max_pending: int, paths: Collection[str], in_progress: Gauge,
                 max_body_bytes: int = 8 << 20, body_timeout_s: float = 30.0, send_timeout_s: float = 60.0) -> None:
        self._app = app
        self._max_pending = max_pending
        self._paths = frozenset(paths)
        self._in_progress = in_progress  # exports num_pending
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._send_timeout_s = send_timeout_s
        self.num_pending = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self._app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self._body_timeout_s):  # in this task, as the server's receive expects
                body = await self._read_body(receive)
        except TimeoutError:
            body = ApiError(408, f"the request body was not sent within {self._body_timeout_s:g} s")
        except _Disconnected:
            return
        if isinstance(body, ApiError):
            await body.to_response(headers={"Connection": "close"})(scope, receive, send)
            return
        if self.num_pending >= self._max_pending:
            refusal = overloaded(f"{self.num_pending} requests in progress (--max-pending-requests "
                                 f"{self._max_pending}); retry later")
            await refusal.to_response()(scope, receive, send)
            return
        self.num_pending += 1
        self._in_progress.inc()
        timed = _TimedSend(send, self._send_timeout_s)
        try:
            await self._app(scope, _replay(body, receive), timed)
        except _ClientStalled:
            _log.info("a client read nothing of its answer for %g s; cut off and its request aborted",
                      self._send_timeout_s)
        finally:
            timed.close()
            self.num_pending -= 1
            self._in_progress.dec()

    async def _read_body(self, receive: Receive) -> bytes | ApiError:
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            received += len(message.get("body", b""))
            if received <= self._max_body_bytes:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
            if received > DRAIN_BYTES:
                break
        if received > self._max_body_bytes:
            return ApiError(413, f"request body exceeds {self._max_body_bytes} bytes")
        return b"".join(chunks)

class _TimedSend:
    """The server's `send`, each call bounded by `timeout_s` (_ClientStalled past it), run in
    the caller's task as the server's own is."""

    def __init__(self, send: Send, timeout_s: float) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._deadline: Deadline | None = None  # made at the first send, on the server's loop

    async def __call__(self, message: Message) -> None:
        deadline = self._deadline = self._deadline or Deadline()
        deadline.start(self._timeout_s)
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if deadline.has_expired():
                raise _ClientStalled from None
            raise
        finally:
            deadline.pause()

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.close()


class _Disconnected(Exception):
    """The client went away before its body was in."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body once, then waits on the client (for its disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed
