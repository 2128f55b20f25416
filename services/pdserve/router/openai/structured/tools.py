"""`tools` and `tool_choice` on chat completions → what the template sees, the output's guide
and how the output is read back (vLLM's semantics).

- `none` (or no tools): plain content; the tools are still shown to the template.
- `auto` (the default with tools): the model decides; its output is read with the configured
  parser (`--enable-auto-tool-choice --tool-call-parser hermes|llama3_json`), else a 400 as vLLM.
- `required`: the output is guided to a JSON array of `{"name", "parameters"}` (one item when
  `parallel_tool_calls` is false), so it always parses.
- a named function: the output is guided to that function's parameters schema; it is the call's
  arguments.
"""
import json
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.common.errors import InvalidRequestError
from pdserve.common.guides import check_guide, json_schema_guide
from pdserve.common.request import Guide
from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.protocol import ChatCompletionRequest, ChatMessage, ToolBody
from pdserve.router.openai.structured.tool_parsers import TOOL_CALL_PARSERS, ToolParser

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolCallConfig:
    """The router's `--enable-auto-tool-choice` and `--tool-call-parser`."""

    enable_auto_tool_choice: bool = False
    parser: str | None = None  # a key of TOOL_CALL_PARSERS


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    template_tools: list[dict[str, Any]] | None = None  # the chat template's `tools`
    guide: Guide | None = None
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # auto: how the output is read


def plan_tools(body: ChatCompletionRequest, config: ToolCallConfig) -> ToolPlan:
    """The request's tool plan; a 400 for a choice that names no tool or cannot be served."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return ToolPlan("none")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    choice = body.tool_choice or "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.parser is None:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              "--tool-call-parser", "tool_choice")
        return ToolPlan("auto", tools, parser=TOOL_CALL_PARSERS[config.parser])
    if choice == "required":
        return ToolPlan("required", tools, _checked(_call_list_guide(body.tools, body.parallel_tool_calls)))
    named = next((tool for tool in body.tools if tool.function.name == choice.function.name), None)
    if named is None:
        raise bad_request(f"tool_choice names function '{choice.function.name}', which is not in 'tools'",
                          "tool_choice.function.name")
    return ToolPlan("named", tools, _checked(json_schema_guide(_parameters(named))), named.function.name)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: an assistant's earlier calls with their
    arguments as JSON values (templates print them with `tojson`), a tool result's call id."""
    rendered = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)}}
                for call in message.tool_calls
            ]
        rendered.append(item)
    return rendered


def _call_list_guide(tools: list[ToolBody], parallel: bool) -> Guide:
    calls = [
        {"type": "object",
         "properties": {"name": {"const": tool.function.name}, "parameters": _parameters(tool)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return json_schema_guide(schema)


def _parameters(tool: ToolBody) -> dict[str, object]:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def _checked(guide: Guide) -> Guide:
    try:
        check_guide(guide, "tools")
    except InvalidRequestError as exc:
        raise bad_request(f"a tool's parameters are not a usable JSON schema: {exc}", "tools") from None
    return guide


def _arguments_value(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
