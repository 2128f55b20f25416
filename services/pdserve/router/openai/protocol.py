"""Request bodies of the OpenAI-compatible API, validated strictly (wrong JSON types are errors).

An explicit `null` for an optional field means its default, as the OpenAI spec and vLLM have it
(clients such as LangChain send `"n": null`); a required field stays required.

Field names follow OpenAI and vLLM's extensions. pdserve's own extensions: `cache_salt`
(tenant isolation of cached blocks), `priority` (retention priority of the prompt's blocks:
one value for the whole prompt, or token ranges with a priority and an optional duration) and
`lora_id` (reserved). Range checks that need the prompt or the model live in `sampling.py`.
Structured output takes OpenAI's `response_format` and vLLM's `guided_*` fields and
`structured_outputs` (checked and turned into one guide in `guided.py`).
"""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_SALT_CHARS = 256
MAX_PRIORITY_RANGES = 64
MAX_BAD_WORDS = 128


def _nullable_optionals(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The JSON schema says what `_null_means_default` accepts: null for each optional field."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        variants = prop.get("anyOf", [prop])
        if name not in required and {"type": "null"} not in variants:
            described = {key: prop.pop(key) for key in ("title", "description", "default") if key in prop}
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **described}


class StrictModel(BaseModel):
    """JSON types must match exactly; NaN and infinities are refused; unknown keys are ignored;
    null for an optional field is its default."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True,
                              json_schema_extra=_nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or (key in fields and fields[key].is_required())}


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Priority = Annotated[int, Field(ge=0, le=100)]


class PriorityRangeBody(StrictModel):
    """Retention priority for prompt tokens [start, end); `end` None means the prompt's end."""

    start: int = Field(0, ge=0)
    end: int | None = Field(None, gt=0)
    priority: Priority
    duration_s: float | None = Field(None, gt=0, le=30 * 24 * 3600)  # 30 days; kvcache's MAX_DURATION_S

    @model_validator(mode="after")
    def _end_after_start(self) -> "PriorityRangeBody":
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


StopBody = str | list[str]
PriorityBody = Priority | list[PriorityRangeBody]
JsonSchemaBody = dict[str, object] | bool


class JsonSchemaFormat(StrictModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: JsonSchemaBody | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (its newer spelling of the `guided_*` fields)."""

    json_: JsonSchemaBody | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


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
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, clamped to [-100, 100]
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    priority: PriorityBody | None = None
    lora_id: int | None = None
    response_format: ResponseFormat | None = None
    guided_json: JsonSchemaBody | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None  # llguidance's Lark
    structured_outputs: StructuredOutputs | None = None
    # ---- detokenization (vLLM's extensions; `skip_special_tokens` above) ----
    spaces_between_special_tokens: bool = True


class CompletionRequest(SamplingBody):
    """`prompt`: a string, a list of token ids, or a batch (list of strings / of token-id lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # None: 16, capped to the context left; 0: echo the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCallBody(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallBody(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers

    def text(self) -> str:
        """The message's text; a list of parts is concatenated."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionBody(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolBody(StrictModel):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceBody = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolBody] | None = Field(None, max_length=128)
    tool_choice: ToolChoiceBody | None = None
    parallel_tool_calls: bool = True


# ---- vLLM's tokenizer routes (`tokenization/`) ------------------------------------------------

class TokenizeRequest(StrictModel):
    """vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`)."""

    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for a chat (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = Field(None, max_length=256)
    tokens: list[int]


class LoadLoraAdapterRequest(StrictModel):
    """`POST /v1/load_lora_adapter` (vLLM's body): the adapter's name and its folder on the workers."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1, max_length=256)
