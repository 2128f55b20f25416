"""run_streams: merging prompts' streams, bounded waits, and closing every stream on the way out."""
import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput, SamplingParams
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.runner import StreamTimeouts, run_streams

QUICK = StreamTimeouts(first_output_s=0.2, output_s=0.2)


def request(rid: str, n: int = 1) -> GenerationRequest:
    return GenerationRequest(RequestId(rid), (1, 2), SamplingParams(n=n))


def out(rid: str, index: int, text: str, finish: str | None = None, error: str | None = None) -> RequestOutput:
    return RequestOutput(RequestId(rid), index, (7,), text, finish_reason=finish, error=error)


class ScriptedBackend:
    """Yields each request's scripted outputs; `None` in a script means: wait forever."""

    def __init__(self, scripts: dict[str, list[RequestOutput | None]]) -> None:
        self.scripts = scripts
        self.closed: list[str] = []

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        try:
            for item in self.scripts[req.request_id]:
                if item is None:
                    await asyncio.Event().wait()
                    continue
                yield item
                await asyncio.sleep(0)
        finally:
            self.closed.append(req.request_id)


async def drain(backend: ScriptedBackend, requests: list[GenerationRequest]) -> list[tuple[int, str]]:
    return [(i, o.text) async for i, o in run_streams(backend, requests, QUICK)]  # type: ignore[arg-type]


def test_merges_prompts_and_waits_for_every_choice() -> None:
    backend = ScriptedBackend({
        "a": [out("a", 0, "a0"), out("a", 1, "a1", "stop"), out("a", 0, "a0'", "length")],
        "b": [out("b", 0, "b0", "stop")],
    })
    events = asyncio.run(drain(backend, [request("a", n=2), request("b")]))
    assert sorted(events) == [(0, "a0"), (0, "a0'"), (0, "a1"), (1, "b0")]
    assert [text for i, text in events if i == 0] == ["a0", "a1", "a0'"]
    assert sorted(backend.closed) == ["a", "b"]


def test_silent_backend_times_out_and_is_closed() -> None:
    backend = ScriptedBackend({"a": [None]})
    with pytest.raises(TimeoutError, match="no output from the generation service within 0.2 s"):
        asyncio.run(drain(backend, [request("a")]))
    assert backend.closed == ["a"]


def test_one_failing_prompt_closes_the_others() -> None:
    backend = ScriptedBackend({"a": [out("a", 0, "x", "error", error="boom")], "b": [out("b", 0, "y"), None]})
    with pytest.raises(ApiError, match="generation failed: boom") as caught:
        asyncio.run(drain(backend, [request("a"), request("b")]))
    assert caught.value.status == 500
    assert sorted(backend.closed) == ["a", "b"]


def test_an_error_of_the_request_s_own_is_a_400_naming_its_parameter() -> None:
    refused = replace(out("a", 0, "x", "error", error="the output's guide refused token 7"), error_param="guide")
    backend = ScriptedBackend({"a": [refused]})
    with pytest.raises(ApiError, match="^the output's guide refused token 7$") as caught:
        asyncio.run(drain(backend, [request("a")]))
    assert (caught.value.status, caught.value.param) == (400, "guide")


def test_stream_ending_before_every_choice_finished_is_503() -> None:
    backend = ScriptedBackend({"a": [out("a", 0, "x", "stop")]})
    with pytest.raises(ApiError, match="generation of a ended before finishing") as caught:
        asyncio.run(drain(backend, [request("a", n=2)]))
    assert caught.value.status == 503


def test_worker_abort_and_bad_choice_index_are_errors() -> None:
    aborted = ScriptedBackend({"a": [out("a", 0, "", "abort")]})
    stray = ScriptedBackend({"a": [out("a", 3, "x")]})
    with pytest.raises(ApiError, match="request a was aborted by the worker"):
        asyncio.run(drain(aborted, [request("a")]))
    with pytest.raises(ApiError, match="worker returned choice index 3 for n=1"):
        asyncio.run(drain(stray, [request("a")]))


def test_backend_exception_propagates() -> None:
    class Unreachable(ScriptedBackend):
        async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
            raise WorkerUnavailableError("w:1", "refused")
            yield  # an async generator that fails at its first step

    with pytest.raises(WorkerUnavailableError):
        asyncio.run(drain(Unreachable({}), [request("a")]))


def test_consumer_leaving_early_closes_every_stream() -> None:
    backend = ScriptedBackend({"a": [out("a", 0, "x"), None], "b": [out("b", 0, "y"), None]})

    async def take_one() -> None:
        events = run_streams(backend, [request("a"), request("b")], StreamTimeouts(60.0, 60.0))  # type: ignore[arg-type]
        await anext(events)
        await events.aclose()

    asyncio.run(take_one())
    assert sorted(backend.closed) == ["a", "b"]


@pytest.mark.parametrize("prompts", [["a"], ["a", "b"]])  # one prompt: no task between; more: one each
def test_the_consumers_time_is_not_a_wait_and_a_silence_after_it_still_times_out(prompts: list[str]) -> None:
    backend = ScriptedBackend({rid: [out(rid, 0, "x"), None] for rid in prompts})

    async def scenario() -> tuple[list[str], Exception]:
        seen = []
        with pytest.raises(TimeoutError) as timed_out:
            async for _, output in run_streams(backend, [request(rid) for rid in prompts], QUICK):  # type: ignore[arg-type]
                seen.append(output.text)
                await asyncio.sleep(0.5)  # a slow client: 2.5 times the output bound, not counted
        return seen, timed_out.value

    seen, error = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert seen == ["x"] * len(prompts) and "within 0.2 s" in str(error)
    assert sorted(backend.closed) == prompts


def test_a_cancelled_consumer_is_cancelled_not_timed_out() -> None:
    backend = ScriptedBackend({"a": [None]})

    async def scenario() -> None:
        task = asyncio.ensure_future(anext(run_streams(backend, [request("a")], StreamTimeouts(60.0, 60.0))))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(scenario(), 10))
