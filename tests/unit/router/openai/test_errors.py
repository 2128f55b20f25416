from pdserve.common.errors import InvalidRequestError, WorkerError, WorkerTimeoutError, WorkerUnavailableError
from pdserve.router.openai.errors import MAX_MESSAGE_CHARS, ApiError, from_exception


def test_envelope_shape() -> None:
    assert ApiError(400, "bad 'n'", "n").to_body() == {
        "error": {"message": "bad 'n'", "type": "BadRequestError", "param": "n", "code": 400}}


def test_messages_are_clipped() -> None:
    error = ApiError(400, "x" * 5000)
    assert error.message == "x" * (MAX_MESSAGE_CHARS - 3) + "..."


def test_exceptions_map_to_statuses() -> None:
    cases = [
        (InvalidRequestError("too long", "prompt"), (400, "too long", "prompt")),
        (WorkerUnavailableError("w:1", "refused"), (503, "generation service unavailable: worker w:1 unavailable: "
                                                        "refused", None)),
        (WorkerTimeoutError("w:1", 2.0), (504, "worker w:1 did not answer within 2 s", None)),
        (WorkerError("engine crashed"), (500, "engine crashed", None)),
        (KeyError("secret detail"), (500, "internal error: KeyError", None)),
    ]
    for exc, expected in cases:
        error = from_exception(exc)
        assert (error.status, error.message, error.param) == expected


def test_an_unavailable_or_overloaded_service_says_when_to_retry_and_nothing_else_does() -> None:
    overloaded = from_exception(WorkerUnavailableError("w:1", "overloaded: 256 requests are waiting")).to_response()
    timed_out = from_exception(WorkerTimeoutError("w:1", 2.0)).to_response()
    assert (overloaded.status_code, overloaded.headers["retry-after"]) == (503, "1")
    assert (timed_out.status_code, timed_out.headers.get("retry-after")) == (504, None)
