"""tool_choice → what the template sees, the output's guide, and how the output is read."""
import json

import pytest

from pdserve.common.request import GuideKind
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import ChatCompletionRequest
from pdserve.router.openai.structured.tool_parsers import TOOL_CALL_PARSERS
from pdserve.router.openai.structured.tools import NO_ARGUMENTS, ToolCallConfig, plan_tools, template_messages
from pdserve.common.settings import TOOL_CALL_PARSER_NAMES

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "d", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "now"}}]
AUTO = ToolCallConfig(enable_auto_tool_choice=True, parser="hermes")


def body(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_without_tools_nothing_changes() -> None:
    plan = plan_tools(body(), ToolCallConfig())
    assert (plan.mode, plan.template_tools, plan.guide) == ("none", None, None)


def test_none_shows_the_tools_and_guides_nothing() -> None:
    plan = plan_tools(body(tools=TOOLS, tool_choice="none"), ToolCallConfig())
    assert (plan.mode, plan.guide) == ("none", None)
    assert plan.template_tools == [
        {"type": "function", "function": {"name": "weather", "description": "d", "parameters": PARAMS}},
        {"type": "function", "function": {"name": "now"}}]


def test_auto_is_the_default_and_needs_the_flags() -> None:
    plan = plan_tools(body(tools=TOOLS), AUTO)
    assert (plan.mode, plan.guide, plan.parser) == ("auto", None, TOOL_CALL_PARSERS["hermes"])
    with pytest.raises(ApiError, match="--enable-auto-tool-choice") as caught:
        plan_tools(body(tools=TOOLS), ToolCallConfig())
    assert caught.value.param == "tool_choice"


def test_required_guides_to_a_list_of_calls() -> None:
    plan = plan_tools(body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ToolCallConfig())
    assert plan.mode == "required" and plan.guide.kind is GuideKind.JSON_SCHEMA
    schema = json.loads(plan.guide.text)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert [item["properties"] for item in schema["items"]["anyOf"]] == [
        {"name": {"const": "weather"}, "parameters": PARAMS}, {"name": {"const": "now"}, "parameters": NO_ARGUMENTS}]
    assert "maxItems" not in json.loads(plan_tools(body(tools=TOOLS, tool_choice="required"), AUTO).guide.text)


def test_a_named_function_guides_to_its_parameters() -> None:
    plan = plan_tools(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}), AUTO)
    assert (plan.mode, plan.function, json.loads(plan.guide.text)) == ("named", "weather", PARAMS)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_refusals(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        plan_tools(body(**fields), AUTO)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_earlier_calls_reach_the_template_with_their_arguments_as_values() -> None:
    request = body(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}])
    assert template_messages(request.messages) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "cold", "tool_call_id": "call_1"}]


def test_every_parser_flag_has_a_parser() -> None:
    assert set(TOOL_CALL_PARSER_NAMES) == set(TOOL_CALL_PARSERS)
