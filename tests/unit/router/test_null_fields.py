"""An explicit null for any optional field means its default (the OpenAI spec allows null there,
and vLLM accepts it); a required field stays required; the JSON schema says so."""
import json

import pytest
from pydantic import BaseModel

from pdserve.router.openai import protocol
from pdserve.router.openai.body import parse_body
from pdserve.router.openai.errors import ApiError

REQUIRED = {protocol.CompletionRequest: {"prompt": "hi"},
            protocol.ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]}}


def json_bytes(body: dict[str, object]) -> bytes:
    return json.dumps(body).encode()


def optional_fields(model: type[BaseModel]) -> list[str]:
    return [name for name, field in model.model_fields.items() if not field.is_required()]


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_null_for_each_optional_field_is_its_default(model: type[BaseModel]) -> None:
    baseline = model.model_validate(REQUIRED[model])
    for name in optional_fields(model):
        with_null = parse_body(json_bytes({**REQUIRED[model], name: None}), model)
        assert getattr(with_null, name) == getattr(baseline, name), name


def test_null_inside_nested_objects_is_the_default_too() -> None:
    body = parse_body(json_bytes({
        "messages": [{"role": "user", "content": None, "name": None}], "stream": True,
        "stream_options": {"include_usage": None, "continuous_usage_stats": None},
    }), protocol.ChatCompletionRequest)
    assert body.messages[0].content is None and body.stream_options == protocol.StreamOptions()


@pytest.mark.parametrize(("model", "field"), [(protocol.CompletionRequest, "prompt"),
                                              (protocol.ChatCompletionRequest, "messages")])
def test_null_for_a_required_field_is_still_a_400(model: type[BaseModel], field: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_body(json_bytes({field: None}), model)
    assert refused.value.status == 400 and refused.value.param == field


def test_a_wrong_type_is_still_refused() -> None:
    with pytest.raises(ApiError, match="'n'"):
        parse_body(b'{"prompt": "hi", "n": "2"}', protocol.CompletionRequest)


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_the_schema_allows_null_exactly_where_the_api_accepts_it(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    for name, prop in schema["properties"].items():
        allows_null = {"type": "null"} in prop.get("anyOf", [prop])
        assert allows_null == (name not in schema.get("required", ())), name
