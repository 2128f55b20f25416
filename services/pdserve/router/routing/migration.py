"""Request migration: a stream whose decode worker dies mid-generation continues on another.

As Dynamo migrates a request, the router re-issues it to another decode worker with the prompt
plus every token already streamed, asking for the tokens still owed; the client's stream goes
on without a visible break. Greedy output equals the uninterrupted one (the continuation's
prompt is the same token sequence the dead worker was extending, and its prefix blocks are
usually still cached on the prefill side). Outputs of the continuation are rewritten to look
like the original request's: its id, its prompt length.

Text: a worker holds back text it cannot send yet (the start of a multi-byte character, the
possible start of a stop string). When it dies, that text was never sent though its tokens
were, so the continuation's first text is preceded by it: the decode of every streamed token
minus the text sent (`Progress.unsent_text`, with the router's tokenizer).

Not migrated: requests with n > 1 (one worker request carries all n choices, each at its own
place), requests that produced nothing yet (those are routed again, see `routed_backend.py`).
Seeded sampling continues with a fresh random stream: it is not the uninterrupted output.
"""
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput

Decode = Callable[[Sequence[int]], str]
PROMPT_CONTEXT_TOKENS = 5  # as the worker's detokenizer (engine/core/detokenizer.py; the router imports no engine)


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    limit: int = 3  # continuations of one request; 0 turns migration off
    decode: Decode | None = None  # token ids -> text (skipping special tokens), to recover held-back text


@dataclass(slots=True)
class Progress:
    """What the client has received of one request so far."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    num_migrations: int = 0

    def add(self, output: RequestOutput) -> None:
        self.token_ids.extend(output.token_ids)
        self.text.append(output.text)

    def unsent_text(self, request: GenerationRequest, decode: Decode | None) -> str:
        """Text of streamed tokens that was never sent (held back by the dead worker), decoded
        after the same few prompt tokens of context the worker's detokenizer used."""
        if decode is None:
            return ""
        context = list(request.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = decode(context)
        full = decode(context + self.token_ids)
        sent = context_text + "".join(self.text)
        return full[len(sent):] if full.startswith(sent) else ""


def can_migrate(request: GenerationRequest, progress: Progress, policy: MigrationPolicy) -> bool:
    owed = request.sampling.max_tokens - len(progress.token_ids)
    return request.sampling.n == 1 and bool(progress.token_ids) and owed > 0 and progress.num_migrations < policy.limit


def continuation(request: GenerationRequest, progress: Progress) -> GenerationRequest:
    """The request that generates what `request` still owes after `progress`, under a new id:
    fewer tokens to go, at least and at most, and a guide that resumes where the output stands."""
    done = len(progress.token_ids)
    sampling = request.sampling
    sampling = dataclasses.replace(
        sampling, max_tokens=sampling.max_tokens - done, min_tokens=max(0, sampling.min_tokens - done),
        guide_done_tokens=sampling.guide_done_tokens + done if sampling.guide is not None else 0)
    return dataclasses.replace(
        request,
        request_id=RequestId(f"{request.request_id}-migrated-{progress.num_migrations}"),
        prompt_token_ids=tuple(request.prompt_token_ids) + tuple(progress.token_ids),
        sampling=sampling,
    )


def as_original(output: RequestOutput, original: GenerationRequest, unsent_text: str) -> RequestOutput:
    """A continuation's output as the original request's (`unsent_text` goes before its text)."""
    return dataclasses.replace(output, request_id=original.request_id, text=unsent_text + output.text,
                               num_prompt_tokens=len(original.prompt_token_ids))
