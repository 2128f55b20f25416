"""What the worker's gRPC service needs from the engine it serves."""
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Protocol

from pdserve.common.errors import PdserveError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo


class AsyncEngine(Protocol):
    """One worker's engine, driven from the worker's event loop.

    Contracts:
    - `prefill_worker` (a decode worker's option) names the prefill worker to compute the prompt
      and push its KV, by its address, and `prefill_worker_id` by its id when the router knows
      it (the decode worker then accepts only that worker's certificate there); an engine
      without disaggregation, or one that judges the prompt better prefilled locally, ignores them.
    - `generate` admits the request and yields its `RequestOutput` deltas; the iterator ends
      once each of the request's `n` completions has yielded an output with `finish_reason`.
      It raises `InvalidRequestError` for a request the engine cannot serve (prompt too long,
      ...) and `DuplicateRequestError` for a request id it already holds.
    - `abort` stops the request and frees its blocks; it is idempotent and returns normally
      for a request that already finished. An iterator whose request was aborted ends.
    - `stats` and `info` return at once, without waiting for an engine step.
    """

    def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                 prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: RequestId) -> None: ...

    def stats(self) -> EngineStats: ...

    def info(self) -> ModelInfo: ...

    async def check_integrity(self) -> KvIntegrity: ...


# Where the caller of `generate` puts a request's outputs, when it only forwards them (the Worker
# service onto a router's output stream): set in the caller's context, the engine may hand it
# the outputs after the first that finish nothing, in order, instead of yielding them through
# every layer between; it yields the rest. The sink returns False for an output it cannot take
# (its stream closed): that one is yielded, so the caller fails and aborts as it would.
OUTPUT_SINK: ContextVar[Callable[[RequestOutput], bool] | None] = ContextVar("output_sink", default=None)


def not_serving_reason(engine: AsyncEngine) -> str | None:
    """None while `engine` takes new requests; else why not. Every health answer (the Worker
    service's own Health RPC and the standard grpc.health.v1 service) reads this: an engine
    that cannot give its figures (draining, wedged, failed) cannot take a request either."""
    try:
        engine.stats()
    except PdserveError as exc:  # e.g. wedged or draining: the engine says why
        return str(exc)
    except Exception as exc:  # any failure of the engine means it cannot serve
        return f"engine failed: {type(exc).__name__}: {exc}"
    return None
