"""Tool calls read out of Hermes and Llama 3 outputs; anything else is content."""
import pytest

from pdserve.router.openai.structured.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ParsedCall,
    ParsedOutput,
    parse_call_list,
)

HERMES = HermesParser()
LLAMA = Llama3JsonParser()


@pytest.mark.parametrize(("text", "expected"), [
    ("Just text.", ParsedOutput("Just text.")),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
     ParsedOutput(None, (ParsedCall("f", '{"x": 1}'),))),
    ('Let me check. <tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {"é": "ü"}}</tool_call>',
     ParsedOutput("Let me check. ", (ParsedCall("f", "{}"), ParsedCall("g", '{"é": "ü"}')))),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', ParsedOutput(None, (ParsedCall("f", '{"x": 1}'),))),
    ('<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
     ParsedOutput('<tool_call>{"name": "f", "arguments": {"x": </tool_call>')),
    ('<tool_call>{"arguments": {}}</tool_call>', ParsedOutput('<tool_call>{"arguments": {}}</tool_call>')),
])
def test_hermes(text: str, expected: ParsedOutput) -> None:
    assert HERMES.parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("The answer is 4.", ParsedOutput("The answer is 4.")),
    ('{"name": "f", "parameters": {"x": 1}}', ParsedOutput(None, (ParsedCall("f", '{"x": 1}'),))),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": [1]}}',
     ParsedOutput(None, (ParsedCall("f", "{}"), ParsedCall("g", '{"y": [1]}')))),
    ('{"name": "f", "parameters": {"x": 1}', ParsedOutput('{"name": "f", "parameters": {"x": 1}')),
    ('{"not": "a call"}', ParsedOutput('{"not": "a call"}')),
])
def test_llama3_json(text: str, expected: ParsedOutput) -> None:
    assert LLAMA.parse(text) == expected


def test_content_len_holds_back_what_may_start_a_call() -> None:
    assert HERMES.content_len("Hello <tool", False) == len("Hello ")
    assert HERMES.content_len("Hello <tool", True) == len("Hello <tool")
    assert HERMES.content_len("Hi <tool_call>{", False) == len("Hi ")
    assert HERMES.content_len("a < b", False) == len("a < b")
    assert LLAMA.content_len("  ", False) == 0
    assert LLAMA.content_len(' {"na', False) == 0
    assert LLAMA.content_len("<|python", False) == 0
    assert LLAMA.content_len("Sure", False) == 4


def test_the_required_call_list() -> None:
    assert parse_call_list('[{"name": "f", "parameters": {"a": "b"}}, {"name": "g", "parameters": {}}]') == \
        ParsedOutput(None, (ParsedCall("f", '{"a": "b"}'), ParsedCall("g", "{}")))
    assert parse_call_list('[{"name": "f", "parameters": {"a"') == ParsedOutput('[{"name": "f", "parameters": {"a"')
    assert parse_call_list("[]") == ParsedOutput("[]")
