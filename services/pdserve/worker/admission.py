"""`BoundedEngine`: the engine the Worker service serves, refusing work it could only queue.

Contracts:
- at most `max_waiting` requests wait at once (admitted, no output yet: queued, prefilling, or
  waiting on a peer's KV); one more is refused at once with `OverloadedError`, never queued;
- while the watchdog finds the engine wedged, `generate` refuses at once and `stats` raises
  `EngineWedgedError` naming why (a wedged engine's figures are stale), so health answers
  NOT_SERVING and the router's load poll takes the worker out of rotation until it recovers;
- everything else is `inner`'s.
"""
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

from pdserve.common.engine_api import AsyncEngine
from pdserve.common.errors import EngineWedgedError, OverloadedError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo


class WedgeCheck(Protocol):
    def wedged_reason(self) -> str | None: ...


class BoundedEngine:
    def __init__(self, inner: AsyncEngine, max_waiting: int, wedge: WedgeCheck) -> None:
        self._inner = inner
        self._max_waiting = max_waiting
        self._wedge = wedge
        self.num_waiting = 0

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        self._check_serving()
        if self.num_waiting >= self._max_waiting:
            raise OverloadedError(f"{self.num_waiting} requests are waiting for their first token "
                                  f"(--max-waiting-requests {self._max_waiting}); retry later")
        self.num_waiting += 1
        is_waiting = True
        try:
            async with aclosing(self._inner.generate(request, prefill_worker, prefill_worker_id)) as outputs:
                async for output in outputs:
                    if is_waiting:
                        self.num_waiting -= 1
                        is_waiting = False
                    yield output
        finally:
            if is_waiting:
                self.num_waiting -= 1

    async def abort(self, request_id: RequestId) -> None:
        await self._inner.abort(request_id)

    def stats(self) -> EngineStats:
        self._check_serving()
        return self._inner.stats()

    def info(self) -> ModelInfo:
        return self._inner.info()

    async def check_integrity(self) -> KvIntegrity:
        return await self._inner.check_integrity()

    def _check_serving(self) -> None:
        reason = self._wedge.wedged_reason()
        if reason is not None:
            raise EngineWedgedError(reason)
