"""Tool calls read back out of generated text, per model family (vLLM's `--tool-call-parser`).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen
  2/2.5/3 and the many models trained on that format); text before the first block is content.
- `llama3_json`: the whole output is one or more `{"name": ..., "parameters": {...}}` objects
  (separated by `;`), optionally after `<|python_tag|>` (Llama 3.1-3.3).

Text that does not parse as the format's calls is content, as vLLM answers it. Each parser
also says how much of a partial output is certainly content (`content_len`), so a stream can
send that text at once and hold back what may be the start of a call.
"""
import json
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ParsedCall, ...] = ()


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedOutput: ...

    def content_len(self, text: str, is_finished: bool) -> int: ...


class HermesParser:
    START = "<tool_call>"
    END = "</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for block in text[start:].split(self.START)[1:]:
            body, _, rest = block.partition(self.END)
            call = _call_of(_json_value(body.strip()), "arguments")
            if call is None or rest.strip():
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start] or None, tuple(calls))

    def content_len(self, text: str, is_finished: bool) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) if is_finished else len(text) - _partial_suffix(text, self.START)


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedOutput(text)
            call = _call_of(value, "parameters", "arguments")
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            position = _skip_separator(body, position)
        return ParsedOutput(None, tuple(calls))

    def content_len(self, text: str, is_finished: bool) -> int:
        head = text.lstrip()
        if is_finished or (head and not head.startswith("{") and not _may_start(head, self.PYTHON_TAG)):
            return len(text)
        return 0  # maybe a call: held until the output is complete


TOOL_CALL_PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def parse_call_list(text: str) -> ParsedOutput:
    """The output of `tool_choice: "required"`: a JSON array of {"name", "parameters"}."""
    items = _json_value(text)
    if not isinstance(items, list) or not items:
        return ParsedOutput(text)
    calls = [_call_of(item, "parameters") for item in items]
    if any(call is None for call in calls):
        return ParsedOutput(text)
    return ParsedOutput(None, tuple(calls))  # type: ignore[arg-type]


def _call_of(value: object, *argument_keys: str) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):
        return ParsedCall(value["name"], arguments)
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _skip_separator(body: str, position: int) -> int:
    while position < len(body) and body[position] in " \t\r\n;":
        position += 1
    return position


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _may_start(head: str, tag: str) -> bool:
    return head.startswith(tag) or tag.startswith(head)
