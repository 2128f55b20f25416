"""`POST /v1/chat/completions`: the chat rendered with the model's template, `n` choices.

Streaming follows OpenAI: each choice first gets a chunk with `delta.role`, then content
deltas; its last chunk carries `finish_reason`.
"""
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.router.openai.body import parse_body, read_body
from pdserve.router.openai.logprobs import LogprobFormatter
from pdserve.router.openai.metrics import RequestTimer
from pdserve.router.openai.prompts import chat_prompt
from pdserve.router.openai.protocol import ChatCompletionRequest
from pdserve.router.openai.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
)
from pdserve.router.openai.sampling import check_chat_supported
from pdserve.router.openai.serving import (
    Event,
    MaxTokens,
    ServingContext,
    UsageCounter,
    collect,
    generation_requests,
    unless_disconnected,
)
from pdserve.router.openai.streaming import SseResponse, prefetch, sse_frame


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class _Chat:
    """One HTTP request's state while its events arrive."""

    ctx: ServingContext
    body: ChatCompletionRequest
    response_id: str
    usage: UsageCounter
    timer: RequestTimer
    formatter: LogprobFormatter
    choices: dict[int, _Choice] = field(default_factory=dict)

    def add(self, event: Event) -> ChatStreamChoice:
        """Record one output; returns it as a streamed choice delta."""
        _, output = event
        self.usage.add(0, output)
        self.timer.on_output(output.index, output)
        choice = self.choices.setdefault(output.index, _Choice())
        choice.text.append(output.text)
        choice.finish_reason = output.finish_reason
        logprobs = None
        if self.body.logprobs:
            entries = self.formatter.chat(output.logprobs, self.body.top_logprobs or 0)
            choice.logprobs += entries
            logprobs = ChatLogprobs(content=entries)
        return ChatStreamChoice(
            index=output.index, delta=ChatDelta(content=output.text), logprobs=logprobs,
            finish_reason=output.finish_reason,
        )

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessageOut(content="".join(c.text)),
                logprobs=ChatLogprobs(content=c.logprobs) if self.body.logprobs else None,
                finish_reason=c.finish_reason,
            )
            for i, c in sorted(self.choices.items())
        ]
        return ChatCompletionResponse(
            id=self.response_id, model=self.ctx.model_name, choices=choices, usage=self.usage.usage()
        )

    def chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, model=self.ctx.model_name, choices=choices)


async def create_chat_completion(request: Request, ctx: ServingContext, response_id: str) -> Response:
    body = parse_body(await read_body(request, ctx.limits.max_body_bytes), ChatCompletionRequest)
    ctx.check_model(body.model)
    ctx = ctx.for_model(body.model)
    check_chat_supported(body)
    prompt = chat_prompt(body, ctx.tokenizer, ctx.info.max_model_len)
    if body.max_completion_tokens is not None:
        max_tokens = MaxTokens(body.max_completion_tokens, None, "max_completion_tokens")
    else:
        max_tokens = MaxTokens(body.max_tokens, None, "max_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = generation_requests(ctx, body, [prompt], response_id, max_tokens, logprobs)
    state = _Chat(
        ctx, body, response_id, UsageCounter([prompt]), RequestTimer(ctx.metrics), ctx.logprobs
    )
    if body.stream:
        _, events = await unless_disconnected(request, prefetch(ctx.run(requests)))
        return SseResponse(_stream(state, events))
    for event in await collect(request, ctx.run(requests)):
        state.add(event)
    state.timer.finish()
    return JSONResponse(state.response().model_dump())


async def _stream(state: _Chat, events: AsyncIterator[Event]) -> AsyncGenerator[bytes, None]:
    options = state.body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options is not None and options.continuous_usage_stats
    for i in range(state.body.n):
        yield sse_frame(state.chunk([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))]))
    async for event in events:
        delta = state.add(event)
        if not (delta.delta.content or delta.logprobs or delta.finish_reason):
            continue
        chunk = state.chunk([delta])
        if continuous:
            chunk.usage = state.usage.usage()
        yield sse_frame(chunk)
    state.timer.finish()
    if include_usage:
        final = state.chunk([])
        final.usage = state.usage.usage()
        yield sse_frame(final)
