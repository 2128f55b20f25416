"""Render a model's Jinja chat template the way Hugging Face `apply_chat_template` does.

The template comes from the checkpoint, so it runs in Jinja's immutable sandbox. Templates
may call `raise_exception(msg)` (to reject, e.g., non-alternating roles) and
`strftime_now(fmt)` (to print today's date); both are provided. A rejection becomes an
InvalidRequestError naming `messages`.
"""
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.common.errors import ConfigError, InvalidRequestError


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        """Raises ConfigError when `source` is not valid Jinja."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ConfigError("chat_template", source[:80], f"invalid Jinja: {err}") from None
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`. `extra` (e.g. `tools`) is passed to the template.

        Raises InvalidRequestError(param="messages") when the template rejects the chat.
        """
        variables = {**self._specials, **extra}
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except _TemplateRejection as err:
            raise InvalidRequestError(f"chat template rejected the messages: {err}", param="messages") from None
        except (jinja2.TemplateError, TypeError, KeyError) as err:
            raise InvalidRequestError(f"chat template failed on the messages: {err}", param="messages") from None


class _TemplateRejection(jinja2.TemplateError):
    """Raised by a template's own `raise_exception(...)` call."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRejection(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja's built-in `tojson` HTML-escapes; chat templates want plain JSON (as HF renders it)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
