"""Request fields → one guide (or a 400 naming the field)."""
import json

import pytest

from pdserve.common.request import Guide, GuideKind
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.openai.structured.guided import guide_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Guide(GuideKind.JSON_SCHEMA, '{"type": "object"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, Guide(GuideKind.REGEX, "[0-9]+")),
    ({"guided_choice": ["a b", 'say "hi"']}, Guide(GuideKind.LARK, 'start: "a b" | "say \\"hi\\""')),
    ({"guided_grammar": 'start: "x"+'}, Guide(GuideKind.LARK, 'start: "x"+')),
    ({"structured_outputs": {"regex": "a|b"}}, Guide(GuideKind.REGEX, "a|b")),
    ({"structured_outputs": {"json_object": True}}, Guide(GuideKind.JSON_SCHEMA, '{"type": "object"}')),
])
def test_each_spelling_gives_its_guide(fields: dict, expected: Guide | None) -> None:
    assert guide_of(completion(**fields)) == expected


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"guided_json": {"type": "nope"}}, "guided_json", "invalid json schema: Invalid type: nope"),
    ({"guided_json": "{not json"}, "guided_json", "'guided_json' is not valid JSON"),
    ({"guided_regex": "(a"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "invalid lark"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "both constrain the output"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs 'json_schema.schema'"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
])
def test_a_bad_or_doubled_guide_is_a_400_naming_its_field(fields: dict, param: str, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        guide_of(completion(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in caught.value.message


def test_chat_bodies_take_the_same_fields() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "guided_choice": ["yes", "no"]})
    assert guide_of(body) == Guide(GuideKind.LARK, 'start: "yes" | "no"')
