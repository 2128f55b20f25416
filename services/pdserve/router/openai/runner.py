"""Running one HTTP request's backend streams (one per prompt) as a single, bounded stream.

Contract of `run_streams`:
- yields `(prompt_index, output)` in arrival order across prompts;
- every wait is bounded: the first output of a prompt within `first_output_timeout_s`, each
  later one within `output_timeout_s`, else `TimeoutError`;
- an output with finish_reason "error" or "abort", a stream that ends before every one of
  its `n` choices finished, or a backend exception ends the whole run with that error;
- leaving early (error, `aclose()`, task cancelled) closes every backend iterator, which
  aborts the requests in the worker (`GenerateBackend`'s contract).
"""
import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.router.backend import GenerateBackend
from pdserve.router.openai.deadline import Deadline
from pdserve.router.openai.errors import ApiError

_CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class StreamTimeouts:
    first_output_s: float
    output_s: float


@dataclass(frozen=True, slots=True)
class _Ended:
    """Marks a prompt's stream as finished (error None) or failed."""

    prompt_index: int
    error: BaseException | None = None


async def run_streams(
    backend: GenerateBackend, requests: Sequence[GenerationRequest], timeouts: StreamTimeouts
) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(requests) == 1:  # one prompt, most requests: its outputs come straight through, no task between
        async with aclosing(_outputs(backend, requests[0], timeouts)) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | _Ended] = asyncio.Queue()
    pumps = [
        asyncio.create_task(_pump(backend, request, i, timeouts, queue), name=f"pump-{request.request_id}")
        for i, request in enumerate(requests)
    ]
    try:
        num_running = len(pumps)
        while num_running:
            item = await queue.get()  # bounded: every pump ends within its timeouts
            if isinstance(item, _Ended):
                if item.error is not None:
                    raise item.error
                num_running -= 1
                continue
            yield item
    finally:
        for pump in pumps:
            pump.cancel()
        if pumps:
            await asyncio.wait(pumps, timeout=_CLOSE_TIMEOUT_S)


async def _pump(
    backend: GenerateBackend,
    request: GenerationRequest,
    prompt_index: int,
    timeouts: StreamTimeouts,
    queue: "asyncio.Queue[tuple[int, RequestOutput] | _Ended]",
) -> None:
    try:
        async with aclosing(_outputs(backend, request, timeouts)) as outputs:
            async for output in outputs:
                await queue.put((prompt_index, output))
        await queue.put(_Ended(prompt_index))
    except Exception as exc:
        await queue.put(_Ended(prompt_index, exc))


async def _outputs(backend: GenerateBackend, request: GenerationRequest,
                   timeouts: StreamTimeouts) -> AsyncIterator[RequestOutput]:
    """`request`'s outputs, checked, each within its bound (the consumer's time between two not
    counted), until each of its `n` choices has finished; the backend's stream is closed after."""
    unfinished = set(range(request.sampling.n))
    stream = backend.generate(request)
    deadline = Deadline()
    try:
        timeout_s = timeouts.first_output_s
        while unfinished:
            deadline.start(timeout_s)
            try:
                output = await anext(stream)
            except StopAsyncIteration:
                raise ApiError(503, f"generation of {request.request_id} ended before finishing") from None
            except asyncio.CancelledError:
                if deadline.has_expired():
                    raise TimeoutError(f"no output from the generation service within {timeout_s:g} s") from None
                raise
            deadline.pause()
            _check_output(output, request)
            if output.is_finished:
                unfinished.discard(output.index)
            timeout_s = timeouts.output_s
            yield output
    finally:
        deadline.close()
        await _close(stream)


def _check_output(output: RequestOutput, request: GenerationRequest) -> None:
    if output.finish_reason == "error" and output.error_param is not None:  # the request's own fault
        raise ApiError(400, output.error or "the request cannot be served", output.error_param)
    if output.finish_reason == "error":
        raise ApiError(500, f"generation failed: {output.error or 'worker error'}")
    if output.finish_reason == "abort":
        raise ApiError(503, f"request {request.request_id} was aborted by the worker")
    if not 0 <= output.index < request.sampling.n:
        raise ApiError(500, f"worker returned choice index {output.index} for n={request.sampling.n}")


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await asyncio.wait_for(aclose(), _CLOSE_TIMEOUT_S)
