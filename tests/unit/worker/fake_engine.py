"""A scripted stand-in for the engine, for tests of the worker's gRPC shell."""
import asyncio
from collections.abc import AsyncIterator

from pdserve.common.errors import PdserveError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput, SamplingParams
from pdserve.common.stats import EngineStats, ModelInfo, WorkerRole

INFO = ModelInfo(
    model_name="tiny-llama", max_model_len=256, tokens_per_block=16,
    block_hash_algorithm="sha256-v1", role=WorkerRole.BOTH, vocab_size=512, eos_token_ids=(2, 7),
)
STATS = EngineStats(
    num_running=3, num_waiting=1, num_free_blocks=90, num_total_blocks=128, num_used_blocks=38,
    num_prefill_tokens_queued=700, prefix_cache_queried_tokens=4096,
    prefix_cache_hit_tokens=1024, num_preemptions=2,
)


def make_request(request_id: str = "req-1", max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(RequestId(request_id), (5, 6, 7), SamplingParams(max_tokens=max_tokens))


def expected_outputs(request: GenerationRequest) -> list[RequestOutput]:
    """What FakeEngine yields for `request`: token 100+i, text "t{i}", "length" at the end."""
    last = request.sampling.max_tokens - 1
    return [
        RequestOutput(request.request_id, 0, (100 + i,), f"t{i}",
                      finish_reason="length" if i == last else None, num_prompt_tokens=3)
        for i in range(request.sampling.max_tokens)
    ]


class FakeEngine:
    """Yields `expected_outputs`; with `hang_after=k`, yields k outputs and then waits forever
    (until cancelled). `fail_with` is raised when generation starts. Records every abort."""

    def __init__(self, hang_after: int | None = None, fail_with: PdserveError | None = None) -> None:
        self.hang_after = hang_after
        self.fail_with = fail_with
        self.stats_error: Exception | None = None
        self.aborted: list[RequestId] = []
        self.prefill_workers: list[str | None] = []  # what each generate call was told
        self.prefill_worker_ids: list[WorkerId | None] = []
        self.abort_seen = asyncio.Event()
        self.hanging = asyncio.Event()

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        self.prefill_workers.append(prefill_worker)
        self.prefill_worker_ids.append(prefill_worker_id)
        if self.fail_with is not None:
            raise self.fail_with
        for i, output in enumerate(expected_outputs(request)):
            if i == self.hang_after:
                self.hanging.set()
                await asyncio.Event().wait()
            yield output

    async def abort(self, request_id: RequestId) -> None:
        self.aborted.append(request_id)
        self.abort_seen.set()

    def stats(self) -> EngineStats:
        if self.stats_error is not None:
            raise self.stats_error
        return STATS

    def info(self) -> ModelInfo:
        return INFO
