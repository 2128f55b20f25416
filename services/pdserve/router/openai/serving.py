"""What completions and chat share: the serving context, request building, usage, collection."""
import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, Guide, RequestOutput
from pdserve.common.stats import LoraAdapterInfo, ModelInfo
from pdserve.router.backend import GenerateBackend, LoraAdapters
from pdserve.router.openai.errors import ApiError, bad_request
from pdserve.router.openai.logprobs import LogprobFormatter
from pdserve.router.openai.metrics import RouterMetrics
from pdserve.router.openai.prompts import Prompt, PromptTokenizer
from pdserve.router.openai.protocol import SamplingBody
from pdserve.router.openai.responses import PromptTokensDetails, Usage
from pdserve.router.openai.runner import StreamTimeouts, run_streams
from pdserve.router.openai.structured.tools import ToolCallConfig
from pdserve.router.openai.sampling import bad_words_token_ids, priority_ranges, resolve_max_tokens, sampling_params
from pdserve.router.openai.access.tenants import Tenant, effective_cache_salt

Event = tuple[int, RequestOutput]  # (prompt index, output)
T = TypeVar("T")
_CANCEL_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ApiLimits:
    """Bounds on what one HTTP request may ask for, how long the router waits for it, and how
    many are in progress at once."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_pending_requests: int = 1024  # generation requests; one more gets 503 + Retry-After at once
    first_output_timeout_s: float = 600.0  # a long prompt's prefill, queueing included
    output_timeout_s: float = 120.0  # between two outputs of one prompt
    keepalive_interval_s: float | None = None  # an SSE comment after this long without an event (None: never)
    max_choices: int = 256  # prompts × n
    body_timeout_s: float = 30.0  # a generation request's whole body, from its headers (then 408)
    send_timeout_s: float = 60.0  # each write of an answer, until the client takes it (then cut off)


@dataclass(frozen=True, slots=True)
class ServingContext:
    backend: GenerateBackend
    tokenizer: PromptTokenizer
    info: ModelInfo
    model_names: tuple[str, ...]  # every name a request may use; responses report the first
    limits: ApiLimits
    metrics: RouterMetrics
    logprobs: LogprobFormatter  # shared, so its token-text cache serves every request
    tenant: Tenant | None = None  # the caller's, once authenticated (None: no API keys configured)
    tool_calls: ToolCallConfig = ToolCallConfig()
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)  # the model's (sampling.with_defaults)
    loras: LoraAdapters | None = None  # the LoRA adapters served (None: none)
    lora_id: int | None = None  # the adapter this request runs under (`for_model`); None: the base model

    @property
    def model_name(self) -> str:
        """The name responses report (vLLM's: the first served name)."""
        return self.model_names[0]

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.model_names and self._adapter(requested) is None:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise ApiError(404, f"the model '{requested}' does not exist; this server serves {served}", "model")

    def default_max_tokens(self, api_default: int | None) -> int | None:
        """Tokens to generate when a request names no bound: the model's default, else the API's
        (either capped to the context left)."""
        model_default = self.sampling_defaults.get("max_tokens")
        return api_default if model_default is None else int(model_default)

    def for_model(self, requested: str | None) -> "ServingContext":
        """This context for a request naming `requested`: under a LoRA adapter's name, it runs
        under that adapter and its responses carry that name, as vLLM answers."""
        adapter = self._adapter(requested) if requested is not None and requested not in self.model_names else None
        if adapter is None:
            return self
        return dataclasses.replace(self, model_names=(adapter.name,), lora_id=adapter.lora_id)

    def _adapter(self, name: str) -> LoraAdapterInfo | None:
        return next((a for a in self.loras.lora_adapters() if a.name == name), None) if self.loras else None

    def run(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Event]:
        timeouts = StreamTimeouts(self.limits.first_output_timeout_s, self.limits.output_timeout_s)
        return run_streams(self.backend, requests, timeouts)


def new_response_id(prefix: str) -> str:
    """`<prefix>-<32 hex digits>`, unique across routers (the worker keys requests by it)."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class MaxTokens:
    """The body's requested maximum (None: unset), the default when unset, and its field name."""

    requested: int | None
    default: int | None
    param: str


def check_choices(limits: ApiLimits, num_prompts: int, n: int) -> None:
    """400 for more prompts × n than `limits.max_choices` (checked before anything is tokenized)."""
    if num_prompts * n > limits.max_choices:
        raise bad_request(f"{num_prompts} prompts × n={n} exceeds {limits.max_choices} choices", "n")


def generation_requests(
    ctx: ServingContext,
    body: SamplingBody,
    prompts: Sequence[Prompt],
    response_id: str,
    max_tokens: MaxTokens,
    logprobs: int | None,
    guide: Guide | None = None,
) -> list[GenerationRequest]:
    """One backend request per prompt, ids `<response_id>-<prompt index>`; `guide` constrains
    every output."""
    check_choices(ctx.limits, len(prompts), body.n)
    bad_words = bad_words_token_ids(body.bad_words, ctx.tokenizer, ctx.info.vocab_size)
    requests = []
    for i, prompt in enumerate(prompts):
        num_tokens = len(prompt.token_ids)
        limit = resolve_max_tokens(
            max_tokens.requested, max_tokens.default, num_tokens, ctx.info.max_model_len, max_tokens.param
        )
        requests.append(GenerationRequest(
            request_id=RequestId(f"{response_id}-{i}"),
            prompt_token_ids=prompt.token_ids,
            sampling=sampling_params(body, limit, logprobs, ctx.info.vocab_size, bad_words, max_tokens.param, guide),
            cache_salt=effective_cache_salt(ctx.tenant, body.cache_salt),
            priorities=priority_ranges(body, num_tokens),
            lora_id=ctx.lora_id,
        ))
    return requests


class UsageCounter:
    """Token counts of one HTTP request: each prompt once, every choice's generated tokens."""

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self._num_prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        self._num_cached = [0] * len(prompts)
        self.num_completion_tokens = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.num_completion_tokens += len(output.token_ids)
        self._num_cached[prompt_index] = max(self._num_cached[prompt_index], output.num_cached_tokens)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self._num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            total_tokens=self._num_prompt_tokens + self.num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._num_cached)),
        )


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; nobody is left to answer."""


async def unless_disconnected(request: Request, work: Coroutine[object, object, T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (a run inside it
    closes its backend streams, so the worker aborts) and `ClientGone` is raised."""
    worker = asyncio.create_task(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({worker, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not worker.done():
            worker.cancel()
            await asyncio.wait({worker}, timeout=_CANCEL_TIMEOUT_S)
    if worker.cancelled():
        raise ClientGone()
    return worker.result()


async def collect(request: Request, events: AsyncIterator[Event]) -> list[Event]:
    """Every event of a run, unless the client disconnects first (see `unless_disconnected`)."""

    async def drain() -> list[Event]:
        return [event async for event in events]

    return await unless_disconnected(request, drain())


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
