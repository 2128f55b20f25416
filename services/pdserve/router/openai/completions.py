"""`POST /v1/completions`: one backend request per prompt, `n` choices each.

Choice `i` of prompt `p` is answered as choice index `p * n + i`, as OpenAI and vLLM do.
`echo` puts the prompt before each choice's text (streamed: in its first chunk), and with
`logprobs` the prompt tokens' logprobs before the generated ones' (the worker computes them
from the prompt's own logits). `max_tokens: 0` with `echo` answers the prompt alone, as vLLM
does: the worker generates one token, which is left out of text, logprobs and usage.
"""
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from pydantic_core import to_json
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.common.request import RequestOutput

from pdserve.router.openai.body import parse_body, read_body
from pdserve.router.openai.structured.guided import guide_of
from pdserve.router.openai.logprobs import LogprobFormatter
from pdserve.router.openai.metrics import RequestTimer
from pdserve.router.openai.prompts import Prompt, completion_prompts, num_prompts, off_loop
from pdserve.router.openai.protocol import CompletionRequest
from pdserve.router.openai.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, now_s
from pdserve.router.openai.sampling import DEFAULT_COMPLETION_MAX_TOKENS, check_completion_supported, with_defaults
from pdserve.router.openai.serving import (
    Event,
    MaxTokens,
    ServingContext,
    UsageCounter,
    check_choices,
    collect,
    generation_requests,
    unless_disconnected,
)
from pdserve.router.openai.streaming import SseResponse, prefetch, sse_frame


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    text_offset: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class _Completion:
    """One HTTP request's state while its events arrive."""

    ctx: ServingContext
    body: CompletionRequest
    response_id: str
    usage: UsageCounter
    timer: RequestTimer
    formatter: LogprobFormatter
    prompts: Sequence[Prompt]
    choices: dict[int, _Choice] = field(default_factory=dict)

    def add(self, event: Event) -> "_Delta":
        """Record one output; returns it as a choice delta (text and logprobs of this step)."""
        prompt_index, output = event
        if self.body.max_tokens == 0:  # the prompt alone: the token generated for it is dropped
            output = replace(output, token_ids=(), text="", logprobs=())
        index = prompt_index * self.body.n + output.index
        self.usage.add(prompt_index, output)
        self.timer.on_output(index, output)
        is_first = index not in self.choices
        choice = self.choices.setdefault(index, _Choice())
        text, logprobs = self._echo(prompt_index, output, choice) if is_first and self.body.echo else ("", None)
        text += output.text
        choice.text.append(text)
        choice.finish_reason = output.finish_reason
        if self.body.logprobs is not None:
            step, choice.text_offset = self.formatter.completion(
                output.logprobs, self.body.logprobs, choice.text_offset
            )
            logprobs = step if logprobs is None else _extend(logprobs, step)
            choice.logprobs = _extend(choice.logprobs, logprobs)
        return _Delta(index, text, logprobs, output.finish_reason)

    def _echo(self, prompt_index: int, output: RequestOutput, choice: _Choice) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text as the client wrote it (token ids: decoded, special tokens kept, as
        vLLM does), and with `logprobs` its tokens' entries."""
        prompt = self.prompts[prompt_index]
        text = prompt.text
        if text is None:
            text = self.ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        if self.body.logprobs is None:
            return text, None
        logprobs, choice.text_offset = self.formatter.echoed_prompt(
            prompt.token_ids, output.prompt_logprobs, self.body.logprobs
        )
        return text, logprobs

    def response(self) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text="".join(c.text), logprobs=c.logprobs, finish_reason=c.finish_reason)
            for i, c in sorted(self.choices.items())
        ]
        return CompletionResponse(
            id=self.response_id, model=self.ctx.model_name, choices=choices, usage=self.usage.usage()
        )


@dataclass(slots=True)
class _Delta:
    """One step of one choice; its model (`choice`) made only for a chunk that needs one."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None

    def choice(self) -> CompletionChoice:
        return CompletionChoice(index=self.index, text=self.text, logprobs=self.logprobs,
                                finish_reason=self.finish_reason)


def _extend(total: CompletionLogprobs | None, step: CompletionLogprobs) -> CompletionLogprobs:
    if total is None:
        return step.model_copy(deep=True)
    total.tokens += step.tokens
    total.token_logprobs += step.token_logprobs
    total.top_logprobs += step.top_logprobs
    total.text_offset += step.text_offset
    return total


async def create_completion(request: Request, ctx: ServingContext, response_id: str) -> Response:
    raw = await read_body(request, ctx.limits.max_body_bytes)
    body = with_defaults(parse_body(raw, CompletionRequest), ctx.sampling_defaults)
    ctx.check_model(body.model)
    ctx = ctx.for_model(body.model)
    check_completion_supported(body)
    check_choices(ctx.limits, num_prompts(body), body.n)
    info = ctx.info
    prompts = await off_loop(len(raw), completion_prompts, body, ctx.tokenizer, info.vocab_size, info.max_model_len)
    requested = 1 if body.max_tokens == 0 else body.max_tokens  # 0: echo alone, see `_Completion.add`
    max_tokens = MaxTokens(requested, ctx.default_max_tokens(DEFAULT_COMPLETION_MAX_TOKENS), "max_tokens")
    requests = generation_requests(ctx, body, prompts, response_id, max_tokens, body.logprobs, guide_of(body))
    state = _Completion(
        ctx, body, response_id, UsageCounter(prompts), RequestTimer(ctx.metrics), ctx.logprobs, prompts
    )
    if body.stream:
        keepalive_s = ctx.limits.keepalive_interval_s
        events = await unless_disconnected(request, prefetch(ctx.run(requests), keepalive_s))
        return SseResponse(_stream(state, events), keepalive_s)
    for event in await collect(request, ctx.run(requests)):
        state.add(event)
    state.timer.finish()
    return JSONResponse(state.response().model_dump())


class ChunkFrames:
    """A stream's chunks without logprobs or usage, as SSE frames: the bytes
    `sse_frame(CompletionResponse(...))` writes (pydantic's own JSON of each string, `created`
    read per chunk), without building two models and serializing them for each token (~5 % of
    the router's time at 64 streams)."""

    def __init__(self, response_id: str, model: str) -> None:
        self._head = b'data: {"id":' + to_json(response_id) + b',"object":"text_completion","created":'
        self._model = b',"model":' + to_json(model) + b',"choices":[{"index":'

    def chunk(self, index: int, text: str, finish_reason: str | None) -> bytes:
        return b"".join((self._head, str(now_s()).encode(), self._model, str(index).encode(), b',"text":',
                         to_json(text), b',"logprobs":null,"finish_reason":', to_json(finish_reason),
                         b'}],"usage":null}\n\n'))


async def _stream(state: _Completion, events: AsyncIterator[Event]) -> AsyncGenerator[bytes, None]:
    options = state.body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options is not None and options.continuous_usage_stats
    frames = ChunkFrames(state.response_id, state.ctx.model_name)
    async for event in events:
        delta = state.add(event)
        if not (delta.text or delta.logprobs or delta.finish_reason):
            continue
        if delta.logprobs is None and not continuous:  # most chunks: no model built, as the model writes it
            yield frames.chunk(delta.index, delta.text, delta.finish_reason)
            continue
        chunk = CompletionResponse(id=state.response_id, model=state.ctx.model_name, choices=[delta.choice()])
        if continuous:
            chunk.usage = state.usage.usage()
        yield sse_frame(chunk)
    state.timer.finish()
    if include_usage:
        yield sse_frame(CompletionResponse(
            id=state.response_id, model=state.ctx.model_name, choices=[], usage=state.usage.usage()
        ))
