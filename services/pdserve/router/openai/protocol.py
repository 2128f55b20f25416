"""Request bodies of the OpenAI-compatible API, validated strictly (wrong JSON types are errors).

Field names follow OpenAI and vLLM's extensions. pdserve's own extensions: `cache_salt`
(tenant isolation of cached blocks), `priority` (retention priority of the prompt's blocks:
one value for the whole prompt, or token ranges with a priority and an optional duration) and
`lora_id` (reserved). Range checks that need the prompt or the model live in `sampling.py`.
"""
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_SALT_CHARS = 256
MAX_PRIORITY_RANGES = 64


class StrictModel(BaseModel):
    """JSON types must match exactly; NaN and infinities are refused; unknown keys are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Priority = Annotated[int, Field(ge=0, le=100)]


class PriorityRangeBody(StrictModel):
    """Retention priority for prompt tokens [start, end); `end` None means the prompt's end."""

    start: int = Field(0, ge=0)
    end: int | None = Field(None, gt=0)
    priority: Priority
    duration_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _end_after_start(self) -> "PriorityRangeBody":
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


StopBody = str | list[str]
PriorityBody = Priority | list[PriorityRangeBody]


class SamplingBody(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StopBody | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    priority: PriorityBody | None = None
    lora_id: int | None = None


class CompletionRequest(SamplingBody):
    """`prompt`: a string, a list of token ids, or a batch (list of strings / of token-id lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)  # None: 16, capped to the context left
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; a list of parts is concatenated."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None


class LoadLoraAdapterRequest(StrictModel):
    """`POST /v1/load_lora_adapter` (vLLM's body): the adapter's name and its folder on the workers."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1, max_length=256)
