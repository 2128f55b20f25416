"""Turning request bodies into prompt token ids: the router tokenizes once, here.

Completions take a string, a list of token ids, or a batch of either; chat messages are
rendered with the model's chat template and then encoded without adding special tokens
(the template already wrote them). Every prompt must leave room for at least one token.
A large body is turned into prompts on a worker thread (`off_loop`): rendering and tokenizing
megabytes takes seconds, and the tokenizer lets go of the interpreter lock for long texts.
"""
import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pdserve.router.openai.sampling import check_token_ids
from pdserve.router.openai.structured.tools import template_messages


OFF_LOOP_BYTES = 64 << 10  # request bodies larger than this are turned into prompts on a worker thread
T = TypeVar("T")


async def off_loop(num_bytes: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`: inline for a body of `num_bytes` up to OFF_LOOP_BYTES, else on a worker thread,
    so the event loop goes on relaying every other stream meanwhile."""
    if num_bytes <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class PromptTokenizer(Protocol):
    """What the router uses of `pdserve.models.tokenizer.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt's token ids and the request field it came from (for error messages)."""

    token_ids: tuple[int, ...]
    param: str
    text: str | None = None  # as the client wrote it (None: given as token ids); `echo` repeats it


def completion_prompts(
    body: CompletionRequest, tokenizer: PromptTokenizer, vocab_size: int, max_model_len: int
) -> list[Prompt]:
    """One `Prompt` per element of a batch (a single prompt is a batch of one)."""
    items = _prompt_items(body)
    if not items:
        raise bad_request("'prompt' must not be empty", "prompt")
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            token_ids = tokenizer.encode(item, add_special_tokens=True)
        else:
            check_token_ids(item, vocab_size, param)
            token_ids = item
        prompt = checked_prompt(token_ids, param, max_model_len)
        prompts.append(Prompt(prompt.token_ids, param, item) if isinstance(item, str) else prompt)
    return prompts


def num_prompts(body: CompletionRequest) -> int:
    """How many prompts the body holds, without tokenizing any."""
    return len(_prompt_items(body))


def _prompt_items(body: CompletionRequest) -> list[str | list[int]]:
    raw = body.prompt
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(token, int) for token in raw):
        return [list(raw)]  # type: ignore[arg-type]  # a single prompt of token ids
    return list(raw)  # type: ignore[arg-type]  # a batch


def chat_prompt(
    body: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    """The rendered chat's token ids (`tools` shown to the template as its `tools`). A template
    that rejects the chat raises a 400 on `messages`."""
    text = render_chat(tokenizer, body.messages, body.add_generation_prompt, tools)
    return checked_prompt(tokenizer.encode(text, add_special_tokens=False), "messages", max_model_len)


def render_chat(tokenizer: PromptTokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The chat's text under the model's template (`/tokenize` renders it the same way)."""
    extra = {} if tools is None else {"tools": tools}
    return tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=add_generation_prompt,
                                         **extra)


def checked_prompt(token_ids: Sequence[int], param: str, max_model_len: int) -> Prompt:
    if not token_ids:
        raise bad_request(f"'{param}' must contain at least one token", param)
    if len(token_ids) >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but '{param}' has "
            f"{len(token_ids)} tokens, leaving no room to generate; shorten it",
            param,
        )
    return Prompt(tuple(token_ids), param)
