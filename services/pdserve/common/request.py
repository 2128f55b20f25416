"""Request and output types shared by router, worker and engine (no torch, no protobuf).

The router builds a `GenerationRequest` from an HTTP body; the worker's engine streams
`RequestOutput` deltas back. `rpc/` converts both to and from protobuf.
"""
import enum
from dataclasses import dataclass, field

from pdserve.common.ids import BlockHash, RequestId

DEFAULT_RETENTION_PRIORITY = 35


@dataclass(slots=True, frozen=True)
class PriorityRange:
    """Retention priority for prompt tokens [start, end); `duration_s` None means forever."""

    start: int
    end: int
    priority: int
    duration_s: float | None = None


@dataclass(slots=True, frozen=True)
class MultimodalSpan:
    """A multimodal item's content hash and the prompt token span it occupies."""

    content_hash: bytes
    offset: int
    length: int


class GuideKind(enum.Enum):
    """The language a guide's text is written in (llguidance compiles each)."""

    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    REGEX = "regex"
    LARK = "lark"  # llguidance's Lark dialect (choices and tool calls are written in it)


@dataclass(slots=True, frozen=True)
class Guide:
    """Structured output: every generated token must keep the text a prefix of the guide's
    language, and the sequence stops (finish_reason "stop") once the guide is complete."""

    kind: GuideKind
    text: str


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-N logprobs per generated token
    include_stop_str_in_output: bool = False
    guide: Guide | None = None  # structured output (JSON schema, regex, choice, tool calls)
    guide_done_tokens: int = 0  # the prompt's last N tokens were generated under `guide` (a migrated request's)
    # ---- prompt logprobs and detokenization (vLLM's semantics) ----
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (the prompt is then computed, not reused)
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # False: adjacent added tokens joined with no separator
    # vLLM's logits processors that change which token wins (see engine/model/logits_processors.py)
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (>0) / multiplies (<=0) logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids unique
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are out
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    lora_id: int | None = None
    priorities: tuple[PriorityRange, ...] = ()
    multimodal: tuple[MultimodalSpan, ...] = ()
    # The prompt's block keys as the router computed them for its routing (kvcache/block_key.py),
    # sent on so that a worker hashes the prompt only to check the first (empty: not sent).
    block_keys: tuple[BlockHash, ...] = ()


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(slots=True, frozen=True)
class RequestOutput:
    """One step's delta for one of a request's `n` completions."""

    request_id: RequestId
    index: int  # which of the n completions
    token_ids: tuple[int, ...]  # tokens generated this step
    text: str  # detokenized text delta (never splits a multi-byte character)
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None  # with `error`: the request's own parameter at fault (a 400), not the service
    # A decode worker's first output: the address of the prefill worker that computed the
    # prompt, or "local" (the path that actually ran, whatever the router asked for).
    prefilled_by: str = ""
    # A completion's first output, when `prompt_logprobs` was asked for: prompt tokens 1.. in
    # order (token 0 has no context, so no logprob).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # A prefill-only request's last output (prefill side): the blocks holding its prompt's KV,
    # in prompt order, held for the peer until released or their lease ends. Read here rather
    # than asked of the engine, which answers only between steps (a whole prefill step later).
    held_block_ids: tuple[int, ...] = ()

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
