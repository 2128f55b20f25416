"""A `Guide` as an llguidance grammar, and the check that refuses a bad one before it runs.

Torch-free: the router checks every guide here (a bad schema or regex is a 400 before any
worker sees it) and each worker compiles the same grammar text (`engine/model/guided.py`).
JSON is generated compact (no free whitespace, as vLLM's `disable_any_whitespace`): with
bounded strings and numbers in the schema, the output is then bounded too, so it completes
within a bounded `max_tokens`.
"""
import json

from llguidance import LLMatcher

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import Guide, GuideKind

JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_of(guide: Guide) -> str:
    """The llguidance grammar (its JSON form) that `guide` describes; not yet checked."""
    if guide.kind is GuideKind.JSON_SCHEMA:
        try:
            return LLMatcher.grammar_from_json_schema(guide.text, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"invalid JSON schema: {exc}", "guide") from None
    if guide.kind is GuideKind.REGEX:
        return LLMatcher.grammar_from_regex(guide.text)
    return LLMatcher.grammar_from_lark(guide.text)


def check_guide(guide: Guide, param: str) -> None:
    """InvalidRequestError naming `param` when llguidance cannot compile `guide`."""
    try:
        grammar = grammar_of(guide)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param) from None
    error = LLMatcher.validate_grammar(grammar, None)
    if error:
        raise InvalidRequestError(f"invalid {guide.kind.value.replace('_', ' ')}: {error.strip()}", param)


def json_schema_guide(schema: object) -> Guide:
    """A guide generating JSON that validates against `schema` (a parsed JSON value)."""
    return Guide(GuideKind.JSON_SCHEMA, json.dumps(schema))


def choice_guide(choices: list[str]) -> Guide:
    """A guide generating exactly one of `choices` (vLLM's `guided_choice`)."""
    return Guide(GuideKind.LARK, "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices))
