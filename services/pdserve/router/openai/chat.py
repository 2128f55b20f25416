"""`POST /v1/chat/completions`: the chat rendered with the model's template, `n` choices.

Streaming follows OpenAI: each choice first gets a chunk with `delta.role`, then content
(and tool-call) deltas; its last chunk carries `finish_reason`. With `tools`, each choice's
text is read as content and tool calls (`tools.py`, `tool_output.py`); structured output
(`response_format`, vLLM's `guided_*`) guides every choice (`guided.py`).
"""
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.router.openai.body import parse_body, read_body
from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.structured.guided import guide_of
from pdserve.router.openai.logprobs import LogprobFormatter
from pdserve.router.openai.metrics import RequestTimer
from pdserve.router.openai.prompts import chat_prompt, off_loop
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
    ToolCallDelta,
)
from pdserve.router.openai.sampling import check_chat_supported, with_defaults
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
from pdserve.router.openai.structured.tool_output import (
    ToolCallStream,
    finish_reason_of,
    read_output,
    tool_calls_out,
)
from pdserve.router.openai.structured.tools import ToolPlan, plan_tools


@dataclass(slots=True)
class _Choice:
    stream: ToolCallStream
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
    plan: ToolPlan
    choices: dict[int, _Choice] = field(default_factory=dict)

    def add(self, event: Event) -> ChatStreamChoice:
        """Record one output; returns it as a streamed choice delta."""
        _, output = event
        self.usage.add(0, output)
        self.timer.on_output(output.index, output)
        choice = self.choices.setdefault(output.index, _Choice(ToolCallStream(self.plan)))
        choice.text.append(output.text)
        choice.finish_reason = output.finish_reason
        content, tool_calls, finish_reason = choice.stream.feed(output.text, output.finish_reason)
        logprobs = None
        if self.body.logprobs:
            entries = self.formatter.chat(output.logprobs, self.body.top_logprobs or 0)
            choice.logprobs += entries
            logprobs = ChatLogprobs(content=entries)
        return ChatStreamChoice(
            index=output.index, delta=_delta(content, tool_calls), logprobs=logprobs,
            finish_reason=finish_reason,
        )

    def response(self) -> ChatCompletionResponse:
        choices = []
        for i, c in sorted(self.choices.items()):
            parsed = read_output(self.plan, "".join(c.text))
            choices.append(ChatChoice(
                index=i,
                message=ChatMessageOut(content=parsed.content, tool_calls=tool_calls_out(parsed)),
                logprobs=ChatLogprobs(content=c.logprobs) if self.body.logprobs else None,
                finish_reason=finish_reason_of(parsed, c.finish_reason),
            ))
        return ChatCompletionResponse(
            id=self.response_id, model=self.ctx.model_name, choices=choices, usage=self.usage.usage()
        )

    def chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, model=self.ctx.model_name, choices=choices)


def _delta(content: str, tool_calls: list[ToolCallDelta]) -> ChatDelta:
    if tool_calls:
        return ChatDelta(content=content or None, tool_calls=tool_calls)  # OpenAI's call chunks carry no ""
    return ChatDelta(content=content)


async def create_chat_completion(request: Request, ctx: ServingContext, response_id: str) -> Response:
    raw = await read_body(request, ctx.limits.max_body_bytes)
    body = with_defaults(parse_body(raw, ChatCompletionRequest), ctx.sampling_defaults)
    ctx.check_model(body.model)
    ctx = ctx.for_model(body.model)
    check_chat_supported(body)
    plan = plan_tools(body, ctx.tool_calls)
    guide = guide_of(body)
    if plan.guide is not None and guide is not None:
        raise bad_request(f"tool_choice {plan.mode!r} already constrains the output; drop the "
                          "structured output field", "tool_choice")
    prompt = await off_loop(len(raw), chat_prompt, body, ctx.tokenizer, ctx.info.max_model_len, plan.template_tools)
    if body.max_completion_tokens is not None:
        max_tokens = MaxTokens(body.max_completion_tokens, ctx.default_max_tokens(None), "max_completion_tokens")
    else:
        max_tokens = MaxTokens(body.max_tokens, ctx.default_max_tokens(None), "max_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = generation_requests(ctx, body, [prompt], response_id, max_tokens, logprobs, plan.guide or guide)
    state = _Chat(
        ctx, body, response_id, UsageCounter([prompt]), RequestTimer(ctx.metrics), ctx.logprobs, plan
    )
    if body.stream:
        keepalive_s = ctx.limits.keepalive_interval_s
        events = await unless_disconnected(request, prefetch(ctx.run(requests), keepalive_s))
        return SseResponse(_stream(state, events), keepalive_s)
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
        if not (delta.delta.content or delta.delta.tool_calls or delta.logprobs or delta.finish_reason):
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
