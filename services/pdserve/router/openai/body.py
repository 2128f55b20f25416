"""Reading a request body within a size bound and validating it into a request model.

FastAPI's body parsing is bypassed on purpose: it answers 422 and reads unbounded bodies.
Here every failure is an `ApiError` (413 for size, 415 for a body that does not say it is JSON,
400 otherwise) whose `param` names the offending field the way a client wrote it
(`messages[0].content`). A body must come as `Content-Type: application/json` (or with no type,
as FastAPI also takes): a web page can post a form or plain text to a local server without the
browser asking it first, but not JSON.
"""
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import Request

from pdserve.router.openai import protocol
from pdserve.router.openai.errors import ApiError, bad_request

ModelT = TypeVar("ModelT", bound=BaseModel)
_MAX_INPUT_REPR = 80
_MODELS: tuple[type[BaseModel], ...] = (
    protocol.CompletionRequest,
    protocol.ChatCompletionRequest,
    protocol.ChatMessage,
    protocol.TextPart,
    protocol.StreamOptions,
    protocol.PriorityRangeBody,
    protocol.ResponseFormat,
    protocol.JsonSchemaFormat,
    protocol.StructuredOutputs,
    protocol.ToolBody,
    protocol.FunctionBody,
    protocol.NamedToolChoice,
    protocol.NamedFunction,
    protocol.ToolCallBody,
    protocol.FunctionCallBody,
    protocol.TokenizeRequest,
    protocol.DetokenizeRequest,
    protocol.LoadLoraAdapterRequest,
)
_FIELD_NAMES = frozenset(field.alias or name for model in _MODELS for name, field in model.model_fields.items())


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body; 415 unless it says it is JSON, 413 as soon as the declared or received size
    exceeds `max_bytes`."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(415, f"Content-Type {media_type!r} is not accepted: send the body as application/json")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[ModelT]) -> ModelT:
    """`raw` validated as `model`; a 400 naming the first offending field otherwise."""
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise describe_validation_error(exc) from None


def describe_validation_error(exc: ValidationError) -> ApiError:
    """One 400 for a pydantic failure: the most specific location and what was expected there."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("request body must be a JSON object")
    located = [(_param(error["loc"]), error) for error in errors]
    deepest = max(len(param) for param, _ in located)
    param = next(param for param, _ in located if len(param) == deepest)
    same_place = [error for where, error in located if where == param]
    return bad_request(_message(param, same_place), param)


def _param(loc: tuple[int | str, ...]) -> str:
    """`('messages', 0, 'content')` -> `messages[0].content`, dropping pydantic's union tags."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in _FIELD_NAMES:
            text += f".{part}" if text else part
    return text


def _message(param: str, errors: list[ErrorDetails]) -> str:
    if errors[0]["type"] == "missing":
        return f"missing required field '{param}'"
    reasons: list[str] = []
    for error in errors:
        reason = error["msg"].removeprefix("Value error, ")
        if reasons:
            reason = reason.removeprefix("Input should be ")
        if reason not in reasons:
            reasons.append(reason)
    got = repr(errors[0]["input"])
    if len(got) > _MAX_INPUT_REPR:
        got = got[: _MAX_INPUT_REPR - 3] + "..."
    return f"invalid value for '{param or 'body'}': {' or '.join(reasons)} (got {got})"


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body exceeds {max_bytes} bytes")
