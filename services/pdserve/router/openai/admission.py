"""`PendingLimit`: the router's bound on generation requests in progress.

At most `max_pending` generation requests are in progress at once, a streamed one until its
last byte is sent; one more is answered at once with 503, OpenAI's error envelope and
`Retry-After`, never queued. Every other route (health, metrics, models) is never refused.
"""
from collections.abc import Collection

from prometheus_client import Gauge
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.openai.errors import overloaded


class PendingLimit:
    def __init__(self, app: ASGIApp, max_pending: int, paths: Collection[str], in_progress: Gauge) -> None:
        self._app = app
        self._max_pending = max_pending
        self._paths = frozenset(paths)
        self._in_progress = in_progress  # exports num_pending
        self.num_pending = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self._app(scope, receive, send)
            return
        if self.num_pending >= self._max_pending:
            refusal = overloaded(f"{self.num_pending} requests in progress (--max-pending-requests "
                                 f"{self._max_pending}); retry later")
            await refusal.to_response()(scope, receive, send)
            return
        self.num_pending += 1
        self._in_progress.inc()
        try:
            await self._app(scope, receive, send)
        finally:
            self.num_pending -= 1
            self._in_progress.dec()
