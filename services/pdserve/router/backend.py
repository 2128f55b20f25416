"""What the HTTP layer needs from whatever runs generation (a worker over gRPC, or a test fake)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from pdserve.common.stats import EngineStats, LoraAdapterInfo, ModelInfo


class GenerateBackend(Protocol):
    """The router's view of one generation service.

    Contracts:
    - `generate` yields `RequestOutput` deltas for every one of the request's `n` completions
      (told apart by `RequestOutput.index`) and ends after each index has yielded one output
      with `finish_reason` set. Text deltas are already detokenized and stop-string trimmed.
    - Abandoning the iterator (`aclose()`, or cancelling the task awaiting it) aborts the
      request in the worker and frees its blocks; the router relies on this when a client
      disconnects or a wait times out.
    - A request the worker refuses raises `InvalidRequestError`; an unreachable worker raises
      `WorkerUnavailableError`. Every call is bounded in time by the implementation.
    """

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: RequestId) -> None: ...

    async def stats(self) -> EngineStats: ...

    async def info(self) -> ModelInfo: ...

    async def close(self) -> None: ...


class LoraAdapters(Protocol):
    """The LoRA adapters served next to the base model (vLLM's `--lora-modules` and runtime loads).

    - `lora_adapters()` lists them now (no I/O);
    - `load_lora_adapter` loads one on every worker: `InvalidRequestError` when the name is taken,
      the files are no adapter of this model, or the workers serve no LoRA;
    - `unload_lora_adapter` unloads one everywhere: `UnknownLoraAdapterError` for an unknown name.
    """

    def lora_adapters(self) -> Sequence[LoraAdapterInfo]: ...

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo: ...

    async def unload_lora_adapter(self, name: str) -> None: ...


class Routing(Protocol):
    """What the HTTP layer may ask of a backend that chooses among many workers.

    - `session_header`: the request header whose value names a session (None: no affinity);
      `for_session(id)` is the backend to run that session's requests on.
    - `describe_route(request_id)`: the routing decision taken for a request, for a response
      header; each decision is told once.
    """

    session_header: str | None

    def for_session(self, session_id: str) -> GenerateBackend: ...

    def describe_route(self, request_id: RequestId) -> str | None: ...

    def metrics_collector(self) -> Collector: ...
