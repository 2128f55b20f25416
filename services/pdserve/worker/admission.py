"""`BoundedEngine`: the engine the Worker service serves, refusing work it could only queue.

Contracts:
- at most `max_waiting` requests wait at once (admitted, no output yet: queued, prefilling, or
  waiting on a peer's KV); one more is refused at once with `OverloadedError`, never queued;
- while the watchdog finds the engine wedged, `generate` refuses at once and `stats` raises
  `EngineWedgedError` naming why (a wedged engine's figures are stale), so health answers
  NOT_SERVING and the router's load poll takes the worker out of rotation until it recovers;
- everything else is `inner`'s.
A prefill worker's KvTransfer orders pass the same checks (`waiting`, through `entry_of`), and
LoRA loads and unloads the drain gate and the wedge check (`entry_of(..., is_request=False)`);
an integrity check is refused at once while wedged, as `stats` is.
"""
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from typing import Protocol

from pdserve.common.engine_api import AsyncEngine
from pdserve.common.errors import EngineWedgedError, OverloadedError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo
from pdserve.worker.drain import DrainGate


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
        async with self.waiting() as first_output:
            async with aclosing(self._inner.generate(request, prefill_worker, prefill_worker_id)) as outputs:
                async for output in outputs:
                    first_output()
                    yield output

    @asynccontextmanager
    async def waiting(self) -> AsyncIterator[Callable[[], None]]:
        """One request admitted past the wedge check and the waiting bound, counted as waiting
        until it calls what this yields (its first output) or the block ends: the Worker
        service's streams, and a prefill worker's orders (which wait until answered)."""
        self._check_serving()
        if self.num_waiting >= self._max_waiting:
            raise OverloadedError(f"{self.num_waiting} requests are waiting for their first token "
                                  f"(--max-waiting-requests {self._max_waiting}); retry later")
        self.num_waiting += 1
        is_waiting = True

        def first_output() -> None:
            nonlocal is_waiting
            if is_waiting:
                self.num_waiting -= 1
                is_waiting = False

        try:
            yield first_output
        finally:
            first_output()

    async def abort(self, request_id: RequestId) -> None:
        await self._inner.abort(request_id)

    def stats(self) -> EngineStats:
        self._check_serving()
        return self._inner.stats()

    def info(self) -> ModelInfo:
        return self._inner.info()

    async def check_integrity(self) -> KvIntegrity:
        self._check_serving()  # its answer would wait out the step that wedged the engine
        return await self._inner.check_integrity()

    def check_serving(self) -> None:
        """EngineWedgedError, naming why, while the watchdog finds the engine wedged."""
        self._check_serving()

    def _check_serving(self) -> None:
        reason = self._wedge.wedged_reason()
        if reason is not None:
            raise EngineWedgedError(reason)


def entry_of(gate: DrainGate, bounded: BoundedEngine, is_request: bool = True
             ) -> Callable[[], AbstractAsyncContextManager]:
    """What a prefill order passes before it reaches the engine, as a Generate stream does: the
    drain gate (refused once draining, and waited for by the drain), then the wedge check and
    the waiting bound (its slot held until it is answered). `is_request` False (a LoRA load or
    unload): the drain gate and the wedge check, no waiting slot."""
    @asynccontextmanager
    async def entered() -> AsyncIterator[None]:
        async with gate.running():
            if not is_request:
                bounded.check_serving()
                yield
                return
            async with bounded.waiting():
                yield

    return entered
