"""A choice's stream of text deltas → content and tool-call deltas that reassemble to the
whole response, however the text was split."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.common.request import Guide, GuideKind
from pdserve.router.openai.structured.tool_output import ToolCallStream, finish_reason_of, read_output
from pdserve.router.openai.structured.tool_parsers import TOOL_CALL_PARSERS, ParsedCall
from pdserve.router.openai.structured.tools import ToolPlan

GUIDE = Guide(GuideKind.JSON_SCHEMA, "{}")
PLANS = {
    "none": ToolPlan("none"),
    "hermes": ToolPlan("auto", parser=TOOL_CALL_PARSERS["hermes"]),
    "llama3_json": ToolPlan("auto", parser=TOOL_CALL_PARSERS["llama3_json"]),
    "required": ToolPlan("required", guide=GUIDE),
    "named": ToolPlan("named", guide=GUIDE, function="weather"),
}
CASES = [
    ("none", "plain <tool_call> text", "stop"),
    ("hermes", 'Checking. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "stop"),
    ("hermes", "a <tool but no call", "stop"),
    ("hermes", '<tool_call>{"name": "f", "argu', "length"),
    ("llama3_json", '{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}', "stop"),
    ("llama3_json", "  No call here.", "stop"),
    ("required", '[{"name": "f", "parameters": {"a": [1, 2]}}]', "stop"),
    ("required", '[{"name": "f", "param', "length"),
    ("named", '{"city": "Oslo"}', "stop"),
]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


@pytest.mark.parametrize(("plan", "text", "finish"), CASES)
@given(cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_reassembles_to_the_whole_response(plan: str, text: str, finish: str, cuts: list[int]) -> None:
    stream = ToolCallStream(PLANS[plan])
    pieces = split(text, cuts)
    content, calls, reasons = "", {}, []
    for i, piece in enumerate(pieces):
        delta_content, deltas, reason = stream.feed(piece, finish if i == len(pieces) - 1 else None)
        content += delta_content
        reasons.append(reason)
        for delta in deltas:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name is not None
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
    whole = read_output(PLANS[plan], text)
    assert (content or None, [ParsedCall(*c) for _, c in sorted(calls.items())]) == (whole.content, list(whole.calls))
    assert [r for r in reasons if r] == [finish_reason_of(whole, finish)]


def test_content_streams_before_the_output_is_complete() -> None:
    stream = ToolCallStream(PLANS["hermes"])
    assert stream.feed("Let me look", None)[0] == "Let me look"
    assert stream.feed(" <tool", None)[0] == " "
    assert stream.feed("_call>{", None)[0] == ""


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    stream = ToolCallStream(PLANS["named"])
    _, first, _ = stream.feed('{"ci', None)
    assert [(d.index, d.function.name, d.function.arguments) for d in first] == [(0, "weather", ""), (0, None, '{"ci')]
    assert first[0].model_dump() == {"index": 0, "id": first[0].id, "type": "function",
                                     "function": {"name": "weather", "arguments": ""}}
    assert first[1].model_dump() == {"index": 0, "function": {"arguments": '{"ci'}}
    assert stream.feed('ty": "Oslo"}', "stop")[1:] == (
        [first[1].model_copy(update={"function": first[1].function.model_copy(update={"arguments": 'ty": "Oslo"}'})})],
        "tool_calls")
