"""What the worker's gRPC service needs from the engine it serves."""
from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo


class AsyncEngine(Protocol):
    """One worker's engine, driven from the worker's event loop.

    Contracts:
    - `prefill_worker` (a decode worker's option) names the prefill worker to compute the prompt
      and push its KV; an engine without disaggregation, or one that judges the prompt better
      prefilled locally, ignores it.
    - `generate` admits the request and yields its `RequestOutput` deltas; the iterator ends
      once each of the request's `n` completions has yielded an output with `finish_reason`.
      It raises `InvalidRequestError` for a request the engine cannot serve (prompt too long,
      ...) and `DuplicateRequestError` for a request id it already holds.
    - `abort` stops the request and frees its blocks; it is idempotent and returns normally
      for a request that already finished. An iterator whose request was aborted ends.
    - `stats` and `info` return at once, without waiting for an engine step.
    """

    def generate(self, request: GenerationRequest, prefill_worker: str | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: RequestId) -> None: ...

    def stats(self) -> EngineStats: ...

    def info(self) -> ModelInfo: ...

    async def check_integrity(self) -> KvIntegrity: ...
