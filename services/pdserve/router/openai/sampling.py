"""Checks that need more than JSON types, and the `SamplingParams` / priorities they yield.

Every refusal is a 400 naming the field. Features pdserve does not implement are refused
rather than silently ignored, so a client never gets output it did not ask for.

The logits processors' fields follow vLLM's rules: `logit_bias` keys are token ids written as
strings, each inside the vocabulary, their values clamped to [-100, 100]; `min_tokens` at most
the tokens to generate; each of `bad_words` is banned as written and, where that is another
token sequence of the same length, with a leading space (so a word is banned at the start of
the text and after a space). The penalties' ranges are the body model's (`protocol.py`).
"""
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from pydantic import ValidationError

from pdserve.common.errors import ConfigError
from pdserve.common.request import Guide, PriorityRange, SamplingParams
from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.protocol import (
    MAX_PRIORITY_RANGES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingBody,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024  # vLLM's bound (its sampler refuses more)
MAX_BAD_WORD_SEQUENCES = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default
MAX_BAD_WORD_TOKENS = 1024  # over all sequences, vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS default

TokenSequences = tuple[tuple[int, ...], ...]

_log = logging.getLogger(__name__)
BodyT = TypeVar("BodyT", bound=SamplingBody)
Defaults = Mapping[str, float | int]


def checked_defaults(defaults: Defaults) -> dict[str, float | int]:
    """The model's default sampling values this API applies (see `with_defaults`); a value a
    request could not send is a ConfigError at start, and a field it has no name for is left out."""
    known = {name: value for name, value in defaults.items() if name in CompletionRequest.model_fields}
    if len(known) < len(defaults):
        _log.warning("the model's default %s: not a parameter of this API, not applied",
                     ", ".join(sorted(set(defaults) - set(known))))
    try:
        CompletionRequest.model_validate({"prompt": "", **known})
    except ValidationError as exc:
        raise ConfigError("generation_config", known, str(exc.errors()[0]["msg"])) from None
    return known


def with_defaults(body: BodyT, defaults: Defaults) -> BodyT:
    """`body` with the model's default (`checked_defaults`) for each field the request left
    unset or null, as vLLM applies a checkpoint's generation_config.json. `max_tokens` is not
    set here: a default is capped to the context left (`ServingContext.default_max_tokens`),
    where a request's own value must fit."""
    update = {name: value for name, value in defaults.items()
              if name in type(body).model_fields and name not in body.model_fields_set and name != "max_tokens"}
    return body.model_copy(update=update) if update else body


def check_supported(body: SamplingBody) -> None:
    """Refuse values of known fields that would change output in ways pdserve does not implement."""
    unsupported = {
        "lora_id": body.lora_id is not None,
    }
    for field, is_set in unsupported.items():
        if is_set:
            raise bad_request(f"'{field}' is not supported by this server; leave it unset", field)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"'best_of' ({body.best_of}) must equal 'n' ({body.n})", "best_of")
    if body.stream_options is not None and not body.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")


def check_completion_supported(body: CompletionRequest) -> None:
    check_supported(body)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("'max_tokens' may be 0 only with 'echo' (the prompt alone, as vLLM answers it)",
                          "max_tokens")
    if body.suffix is not None:
        raise bad_request("'suffix' is not supported by this server", "suffix")


def check_chat_supported(body: ChatCompletionRequest) -> None:
    check_supported(body)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}", "stop")
    for string in strings:
        if not string or len(string) > MAX_STOP_CHARS:
            raise bad_request(f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(strings)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"token id {token_id} at {param}[{position}] is outside the vocabulary [0, {vocab_size})",
                param,
            )


def resolve_max_tokens(
    requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int, param: str
) -> int:
    """Tokens to generate: `requested`, else `default` capped to the room left, else all the room.

    Raises a 400 naming `param` when `requested` does not fit the context.
    """
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} "
            f"prompt tokens plus {param}={requested} would need {num_prompt_tokens + requested}; "
            f"reduce the prompt or '{param}'",
            param,
        )
    return requested


def sampling_params(
    body: SamplingBody, max_tokens: int, logprobs: int | None, vocab_size: int,
    bad_words: TokenSequences = (), max_tokens_param: str = "max_tokens", guide: Guide | None = None,
) -> SamplingParams:
    """`SamplingParams` for a body already passed through `check_supported`; `bad_words` as
    `bad_words_token_ids` tokenized them, `max_tokens_param` the field that set `max_tokens`."""
    stop_token_ids = list(body.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=body.seed,
        stop=stop_strings(body.stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=body.ignore_eos,
        n=body.n,
        logprobs=logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        guide=guide,
        prompt_logprobs=prompt_logprobs(body),
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=logit_bias(body, vocab_size),
        min_tokens=min_tokens(body, max_tokens, max_tokens_param),
        bad_words=bad_words,
    )


def prompt_logprobs(body: SamplingBody) -> int | None:
    """Top-N logprobs of the prompt's tokens: a completion echoing its prompt with `logprobs`."""
    if isinstance(body, CompletionRequest) and body.echo:
        return body.logprobs
    return None


def priority_ranges(body: SamplingBody, num_prompt_tokens: int) -> tuple[PriorityRange, ...]:
    """The body's retention priorities as prompt token ranges, sorted and non-overlapping."""
    if body.priority is None:
        return ()
    if isinstance(body.priority, int):
        return (PriorityRange(0, num_prompt_tokens, body.priority),)
    if len(body.priority) > MAX_PRIORITY_RANGES:
        raise bad_request(f"at most {MAX_PRIORITY_RANGES} priority ranges are allowed", "priority")
    ranges = []
    for i, item in enumerate(body.priority):
        end = num_prompt_tokens if item.end is None else item.end
        if end > num_prompt_tokens or item.start >= end:
            raise bad_request(
                f"priority[{i}] covers tokens [{item.start}, {end}) outside the prompt's "
                f"{num_prompt_tokens} tokens",
                f"priority[{i}]",
            )
        ranges.append(PriorityRange(item.start, end, item.priority, item.duration_s))
    ranges.sort(key=lambda r: r.start)
    for before, after in zip(ranges, ranges[1:]):
        if after.start < before.end:
            raise bad_request(f"priority ranges overlap at token {after.start}", "priority")
    return tuple(ranges)


class Encoder(Protocol):
    """What `bad_words_token_ids` uses of the router's tokenizer (`prompts.PromptTokenizer` has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def logit_bias(body: SamplingBody, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """(token id, clamped bias) pairs sorted by token id; a key written twice keeps its last value."""
    biases: dict[int, float] = {}
    if len(body.logit_bias or {}) > MAX_LOGIT_BIAS_TOKENS:
        raise bad_request(f"logit_bias names {len(body.logit_bias or {})} tokens; at most {MAX_LOGIT_BIAS_TOKENS}",
                          "logit_bias")
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias names token id {token_id}, outside the vocabulary [0, {vocab_size})",
                              "logit_bias")
        biases[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias))
    return tuple(sorted(biases.items()))


def min_tokens(body: SamplingBody, max_tokens: int, param: str) -> int:
    """`body.min_tokens`; a 400 when it exceeds the tokens to generate (`param` names that limit)."""
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) must be less than or equal to {param} ({max_tokens})",
                          "min_tokens")
    return body.min_tokens


def bad_words_token_ids(words: Sequence[str] | None, tokenizer: Encoder, vocab_size: int) -> TokenSequences:
    """The token sequences that ban `words`, as vLLM's `SamplingParams.update_from_tokenizer` makes them."""
    sequences: list[tuple[int, ...]] = []
    for i, word in enumerate(words or ()):
        if word in (words or ())[:i]:
            continue  # vLLM drops repeated words
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise bad_request(f"bad_words[{i}] ({word!r}) has no tokens", f"bad_words[{i}]")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise bad_request(f"bad_words make {len(sequences)} token sequences; at most {MAX_BAD_WORD_SEQUENCES} "
                          "are allowed", "bad_words")
    if sum(len(s) for s in sequences) > MAX_BAD_WORD_TOKENS:
        raise bad_request(f"bad_words make more than {MAX_BAD_WORD_TOKENS} tokens in all", "bad_words")
    if any(not 0 <= t < vocab_size for s in sequences for t in s):
        raise bad_request(f"bad_words tokenize to ids outside the model's vocabulary [0, {vocab_size})", "bad_words")
    return tuple(sequences)
