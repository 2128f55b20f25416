"""OpenAI's error envelope, and the handlers that make every failure answer with it.

Every error response has the body `{"error": {"message", "type", "param", "code"}}` with a
message of at most `MAX_MESSAGE_CHARS` characters. A 503 for an overloaded or unavailable
service also says when to retry (`Retry-After`, seconds), so clients back off instead of waiting. FastAPI's own 422 never reaches a client:
the handlers below turn request-validation failures into 400.
"""
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.common.errors import InvalidRequestError, PdserveError, UnknownLoraAdapterError, WorkerUnavailableError

MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 128
RETRY_AFTER_S = 1

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ApiError(Exception):
    """A failure to answer with the envelope and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = clip(message, MAX_MESSAGE_CHARS)
        self.param = None if param is None else clip(param, MAX_PARAM_CHARS)
        self.retry_after_s = retry_after_s

    def to_body(self) -> dict[str, dict[str, object]]:
        err_type = _ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "")
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.status}}

    def to_response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        if self.retry_after_s is not None:
            headers = {**(headers or {}), "Retry-After": str(self.retry_after_s)}
        return JSONResponse(self.to_body(), status_code=self.status, headers=headers)


def overloaded(message: str) -> ApiError:
    """A 503 that tells the client to come back in `RETRY_AFTER_S` seconds."""
    return ApiError(503, message, retry_after_s=RETRY_AFTER_S)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_exception(exc: BaseException) -> ApiError:
    """The envelope for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), exc.param)
    if isinstance(exc, UnknownLoraAdapterError):
        return ApiError(404, str(exc), "lora_name")
    if isinstance(exc, WorkerUnavailableError):
        return overloaded(f"generation service unavailable: {exc}")
    if isinstance(exc, TimeoutError):
        return ApiError(504, str(exc) or "timed out waiting for the generation service")
    if isinstance(exc, PdserveError):
        return ApiError(500, str(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}")


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    return from_exception(exc).to_response()


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    where = ".".join(str(part) for part in errors[0]["loc"]) if errors else None
    return bad_request(f"invalid request: {errors[0]['msg'] if errors else exc}", where).to_response()


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, StarletteHTTPException):  # registered for this type only
        return from_exception(exc).to_response()
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    return ApiError(exc.status_code, message).to_response(headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error raised by a route, including FastAPI's own, with the envelope."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_api_error)
