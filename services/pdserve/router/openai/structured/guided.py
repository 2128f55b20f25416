"""Structured output fields of a request body → at most one `Guide`, checked before it is sent.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (llguidance's Lark) and its newer
`structured_outputs` object all say the same thing; a body may use one of them. A guide that
does not compile (a bad schema, regex or grammar) is a 400 naming the field.
"""
import json

from pdserve.common.errors import InvalidRequestError
from pdserve.common.guides import check_guide, choice_guide, json_schema_guide
from pdserve.common.request import Guide, GuideKind
from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.protocol import JsonSchemaBody, ResponseFormat, SamplingBody, StructuredOutputs

ANY_JSON_OBJECT = {"type": "object"}


def guide_of(body: SamplingBody) -> Guide | None:
    """The body's one guide, compiled once here to refuse a bad one; None when unguided."""
    found = [(param, guide) for param, guide in _guides(body) if guide is not None]
    if len(found) > 1:
        raise bad_request(f"'{found[0][0]}' and '{found[1][0]}' both constrain the output; send one", found[1][0])
    if not found:
        return None
    param, guide = found[0]
    try:
        check_guide(guide, param)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param) from None
    return guide


def _guides(body: SamplingBody) -> list[tuple[str, Guide | None]]:
    choices = body.guided_choice
    return [
        ("response_format", _response_format_guide(body.response_format)),
        ("guided_json", None if body.guided_json is None else _json_guide(body.guided_json, "guided_json")),
        ("guided_regex", None if body.guided_regex is None else Guide(GuideKind.REGEX, body.guided_regex)),
        ("guided_choice", None if choices is None else choice_guide(choices)),
        ("guided_grammar", None if body.guided_grammar is None else Guide(GuideKind.LARK, body.guided_grammar)),
        ("structured_outputs", _structured_outputs_guide(body.structured_outputs)),
    ]


def _response_format_guide(response_format: ResponseFormat | None) -> Guide | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json_schema_guide(ANY_JSON_OBJECT)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format of type 'json_schema' needs 'json_schema.schema'",
                          "response_format.json_schema")
    return json_schema_guide(spec.schema_)


def _structured_outputs_guide(outputs: StructuredOutputs | None) -> Guide | None:
    if outputs is None:
        return None
    guides = [
        None if outputs.json_ is None else _json_guide(outputs.json_, "structured_outputs.json"),
        None if outputs.regex is None else Guide(GuideKind.REGEX, outputs.regex),
        None if outputs.choice is None else choice_guide(outputs.choice),
        None if outputs.grammar is None else Guide(GuideKind.LARK, outputs.grammar),
        json_schema_guide(ANY_JSON_OBJECT) if outputs.json_object else None,
    ]
    given = [guide for guide in guides if guide is not None]
    if len(given) != 1:
        raise bad_request("'structured_outputs' must set exactly one of json, regex, choice, grammar, json_object",
                          "structured_outputs")
    return given[0]


def _json_guide(schema: JsonSchemaBody | str, param: str) -> Guide:
    """vLLM takes a schema as a JSON object or as its text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"'{param}' is not valid JSON: {exc}", param) from None
    return json_schema_guide(schema)
