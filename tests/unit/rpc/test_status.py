"""Typed errors survive the trip worker → gRPC status → client."""
import grpc
import pytest

from pdserve.common.errors import (
    DuplicateRequestError,
    EngineWedgedError,
    InvalidRequestError,
    OutOfBlocksError,
    OverloadedError,
    PdserveError,
    IncompatiblePeerError,
    TransferError,
    UnknownLoraAdapterError,
    UnknownRequestError,
    WorkerError,
    WorkerTimeoutError,
    WorkerUnavailableError,
)
from pdserve.rpc.status import MAX_DETAILS_CHARS, PARAM_KEY, error_from_status, status_of

ADDRESS = "10.0.0.1:50051"


@pytest.mark.parametrize(
    ("error", "code", "expected_type"),
    [
        (InvalidRequestError("bad top_p", "top_p"), grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
        (DuplicateRequestError("r1 is running"), grpc.StatusCode.ALREADY_EXISTS, DuplicateRequestError),
        (UnknownRequestError("r9"), grpc.StatusCode.NOT_FOUND, UnknownRequestError),
        (UnknownLoraAdapterError("no adapter sql"), grpc.StatusCode.NOT_FOUND, UnknownLoraAdapterError),
        (OutOfBlocksError(8, 2), grpc.StatusCode.RESOURCE_EXHAUSTED, WorkerUnavailableError),
        (OverloadedError("256 requests waiting"), grpc.StatusCode.RESOURCE_EXHAUSTED, WorkerUnavailableError),
        (WorkerUnavailableError("x:1", "draining"), grpc.StatusCode.UNAVAILABLE, WorkerUnavailableError),
        (EngineWedgedError("no step for 61 s"), grpc.StatusCode.UNAVAILABLE, WorkerUnavailableError),
        (TransferError("peer gone"), grpc.StatusCode.ABORTED, TransferError),
        (IncompatiblePeerError("dtype differs"), grpc.StatusCode.FAILED_PRECONDITION, IncompatiblePeerError),
        (PdserveError("boom"), grpc.StatusCode.INTERNAL, WorkerError),
    ],
)
def test_each_error_type_has_one_code(error: PdserveError, code: grpc.StatusCode, expected_type: type) -> None:
    sent_code, details, metadata = status_of(error)
    assert (sent_code, details) == (code, str(error))
    received = error_from_status(sent_code, details, metadata, ADDRESS, 5.0)
    assert type(received) is expected_type


def test_invalid_request_keeps_its_param() -> None:
    code, details, metadata = status_of(InvalidRequestError("top_p must be in (0, 1]", "top_p"))
    assert metadata == ((PARAM_KEY, "top_p"),)
    received = error_from_status(code, details, metadata, ADDRESS, 5.0)
    assert (str(received), received.param) == ("top_p must be in (0, 1]", "top_p")


def test_deadline_becomes_a_timeout_naming_the_deadline() -> None:
    received = error_from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "", (), ADDRESS, 2.5)
    assert isinstance(received, WorkerTimeoutError) and isinstance(received, TimeoutError)
    assert (received.address, received.timeout_s) == (ADDRESS, 2.5)


def test_unavailable_names_the_worker() -> None:
    received = error_from_status(grpc.StatusCode.UNAVAILABLE, "connection refused", (), ADDRESS, 5.0)
    assert str(received) == f"worker {ADDRESS} unavailable: connection refused"


def test_details_are_capped_so_a_huge_echoed_id_still_arrives_as_its_own_error() -> None:
    code, details, metadata = status_of(InvalidRequestError(f"request id {'x' * 100_000 + '#'!r} is reserved", "request_id"))
    assert (code, len(details), details[-3:], metadata) == (
        grpc.StatusCode.INVALID_ARGUMENT, MAX_DETAILS_CHARS, "...", ((PARAM_KEY, "request_id"),))
