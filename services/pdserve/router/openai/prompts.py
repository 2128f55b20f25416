"""Turning request bodies into prompt token ids: the router tokenizes once, here.

Completions take a string, a list of token ids, or a batch of either; chat messages are
rendered with the model's chat template and then encoded without adding special tokens
(the template already wrote them). Every prompt must leave room for at least one token.
"""
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pdserve.router.openai.sampling import check_token_ids
from pdserve.router.openai.structured.tools import template_messages


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
    raw = body.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(token, int) for token in raw):
        items = [list(raw)]  # type: ignore[arg-type]  # a single prompt of token ids
    else:
        items = list(raw)  # type: ignore[arg-type]  # a batch
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
