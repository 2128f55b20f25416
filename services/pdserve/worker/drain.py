"""`DrainGate`: the engine the Worker service serves, closed to new requests once the worker drains.

Contracts, once `close(reason)` is called (the worker got SIGTERM or SIGINT):
- `generate` refuses at once with `WorkerDrainingError` (gRPC UNAVAILABLE: the router routes
  the request to another worker, or answers 503 naming why), never queues;
- `stats` raises it too, so health answers NOT_SERVING naming why and the router's load poll
  takes the worker out of rotation;
- requests admitted before keep streaming; `wait_idle` returns once the last of them ended.
Everything else is `inner`'s. A prefill worker's KvTransfer orders pass the same gate
(`running`), so they too are refused once draining and finish within the drain.
"""
import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

from pdserve.common.engine_api import AsyncEngine
from pdserve.common.errors import WorkerDrainingError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo


class DrainGate:
    def __init__(self, inner: AsyncEngine) -> None:
        self._inner = inner
        self._closed_reason: str | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.num_running = 0

    def close(self, reason: str) -> None:
        """Refuse new requests from now on; `reason` is what a refused client reads."""
        self._closed_reason = reason

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no admitted request runs; False if some still run after `timeout_s`."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        async with self.running():
            async with aclosing(self._inner.generate(request, prefill_worker, prefill_worker_id)) as outputs:
                async for output in outputs:
                    yield output

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """One request through the gate (refused once it is closed), counted as running until
        the block ends: the Worker service's streams, and a prefill worker's orders."""
        self._check_open()
        self.num_running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_running -= 1
            if self.num_running == 0:
                self._idle.set()

    async def abort(self, request_id: RequestId) -> None:
        await self._inner.abort(request_id)

    def stats(self) -> EngineStats:
        self._check_open()
        return self._inner.stats()

    def info(self) -> ModelInfo:
        return self._inner.info()

    async def check_integrity(self) -> KvIntegrity:
        return await self._inner.check_integrity()

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise WorkerDrainingError(self._closed_reason)
