"""Request migration: a decode worker that dies mid-stream hands its request to another, which
continues from the tokens already streamed; the client sees one uninterrupted answer."""
import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, Guide, GuideKind, RequestOutput, SamplingParams
from pdserve.engine.core.detokenizer import PROMPT_CONTEXT_TOKENS as WORKER_CONTEXT_TOKENS
from pdserve.router.routing import migration
from pdserve.router.routing.migration import MigrationPolicy, Progress, continuation
from tests.unit.router.routing.cluster_fakes import FakeWorker, info
from tests.unit.router.routing.test_routed_backend import routed

PROMPT = tuple(range(300, 318))


class ExtendingWorker(FakeWorker):
    """Generates token len(prompt) + step, as a greedy model extends its sequence: a
    continuation from prompt + streamed tokens yields exactly what was still to come. Its text
    for a token is held back one step (as a worker holds a possible stop string) when
    `holds_back`; `fail_generate_after` outputs, then the stream breaks."""

    holds_back = False
    fail_after_by_prompt_len: dict[int, int] = {}  # any worker given this prompt length fails after so many

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        self._check()
        self.generated.append((request.request_id, prefill_worker))
        self.prompts = getattr(self, "prompts", []) + [request.prompt_token_ids]
        held = ""
        fail_after = self.fail_after_by_prompt_len.get(len(request.prompt_token_ids), self.fail_generate_after)
        for step in range(request.sampling.max_tokens):
            if fail_after == step:
                raise WorkerUnavailableError(self.address, "stream broke")
            token = len(request.prompt_token_ids) + step
            is_last = step == request.sampling.max_tokens - 1
            text, held = (held, word(token)) if self.holds_back and not is_last else (held + word(token), "")
            yield RequestOutput(request.request_id, 0, (token,), text, finish_reason="length" if is_last else None,
                                num_prompt_tokens=len(request.prompt_token_ids))


def word(token: int) -> str:
    return f"w{token} "


def decode(token_ids: Sequence[int]) -> str:
    return "".join(word(t) for t in token_ids if t < 300)  # prompt tokens (300..) decode to nothing


def request(max_tokens: int = 6, n: int = 1) -> GenerationRequest:
    return GenerationRequest(RequestId("r-0"), PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n))


def run(workers: dict[str, ExtendingWorker], req: GenerationRequest,
        policy: MigrationPolicy = MigrationPolicy(decode=decode)) -> tuple[list[RequestOutput], object]:
    async def scenario() -> tuple[list[RequestOutput], object]:
        backend = await routed(workers, migration=policy)
        outputs = [out async for out in backend.generate(req)]
        return outputs, backend._cluster.counters

    return asyncio.run(scenario())


def uninterrupted() -> list[RequestOutput]:
    return run({"x:1": ExtendingWorker("x:1", info())}, request())[0]


@pytest.mark.parametrize("holds_back", [False, True])
def test_a_worker_dying_mid_stream_is_invisible_to_the_client(holds_back: bool) -> None:
    workers = {a: ExtendingWorker(a, info()) for a in ("a:1", "b:2")}
    for worker in workers.values():
        worker.holds_back = holds_back
    workers["a:1"].fail_generate_after = 3
    outputs, counters = run(workers, request())
    expected = uninterrupted()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert "".join(o.text for o in outputs) == "".join(o.text for o in expected)
    assert {o.request_id for o in outputs} == {"r-0"} and {o.num_prompt_tokens for o in outputs} == {len(PROMPT)}
    assert outputs[-1].finish_reason == "length"
    assert workers["b:2"].generated == [("r-0-migrated-0", None)]
    assert workers["b:2"].prompts == [PROMPT + (18, 19, 20)]
    assert counters.migrations == {"a:1": 1}


def test_a_request_migrates_again_up_to_the_limit() -> None:
    fails = {len(PROMPT): 2, len(PROMPT) + 2: 1}  # the original and the first continuation break
    workers = {a: ExtendingWorker(a, info()) for a in ("a:1", "b:2", "c:3")}
    for worker in workers.values():
        worker.fail_after_by_prompt_len = fails
    outputs, counters = run(workers, request())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in uninterrupted()]
    assert sum(counters.migrations.values()) == 2 and len(counters.migrations) == 2
    with pytest.raises(WorkerUnavailableError, match="stream broke"):
        run(workers, request(), MigrationPolicy(limit=1, decode=decode))


@pytest.mark.parametrize(("limit", "n"), [(0, 1), (3, 2)], ids=["migration-off", "n-choices"])
def test_what_is_not_migrated_fails_as_before(limit: int, n: int) -> None:
    workers = {a: ExtendingWorker(a, info()) for a in ("a:1", "b:2")}
    workers["a:1"].fail_generate_after = 2
    with pytest.raises(WorkerUnavailableError, match="stream broke"):
        run(workers, request(n=n), MigrationPolicy(limit=limit, decode=decode))
    assert workers["b:2"].generated == []


def test_no_other_decode_worker_ends_the_stream_with_the_failure() -> None:
    workers = {"a:1": ExtendingWorker("a:1", info())}
    workers["a:1"].fail_generate_after = 2
    with pytest.raises(WorkerUnavailableError, match="stream broke"):
        run(workers, request())


def test_the_continuation_asks_for_what_is_still_owed() -> None:
    progress = Progress(token_ids=[7, 8], text=["a", "b"])
    follow = continuation(request(max_tokens=6), progress)
    assert (follow.prompt_token_ids, follow.sampling.max_tokens) == (PROMPT + (7, 8), 4)
    assert follow.request_id != "r-0" and follow.sampling.temperature == 0.0


def test_a_continuation_owes_fewer_minimum_tokens_and_resumes_its_guide() -> None:
    guided = dataclasses.replace(request(max_tokens=6), sampling=SamplingParams(
        max_tokens=6, min_tokens=4, temperature=0.0, guide=Guide(GuideKind.REGEX, "[a-z]+")))
    follow = continuation(guided, Progress(token_ids=[7, 8, 9], text=["a", "b", "c"]))
    assert (follow.sampling.max_tokens, follow.sampling.min_tokens, follow.sampling.guide_done_tokens) == (3, 1, 3)
    again = continuation(follow, Progress(token_ids=[10, 11], text=["d", "e"], num_migrations=1))
    assert (again.sampling.max_tokens, again.sampling.min_tokens, again.sampling.guide_done_tokens) == (1, 0, 5)
    assert continuation(request(), Progress(token_ids=[7], text=["a"])).sampling.guide_done_tokens == 0


def test_the_router_decodes_with_the_workers_prompt_context() -> None:
    assert migration.PROMPT_CONTEXT_TOKENS == WORKER_CONTEXT_TOKENS
