"""pdserve's typed errors on the wire: one gRPC status code per error type, both ways.

The worker turns an error into (code, details, trailing metadata); the client turns the
status back into the same error type, so the router maps it to an HTTP status without
knowing gRPC exists.
"""
import grpc

from pdserve.common.errors import (
    DuplicateRequestError,
    EngineWedgedError,
    IncompatiblePeerError,
    InvalidRequestError,
    OutOfBlocksError,
    OverloadedError,
    PdserveError,
    PermissionDeniedError,
    TransferError,
    UnknownLoraAdapterError,
    UnknownPeerError,
    UnknownRequestError,
    WorkerError,
    WorkerDrainingError,
    WorkerTimeoutError,
    WorkerUnavailableError,
)

PARAM_KEY = "pdserve-param"  # trailing metadata: the request field an INVALID_ARGUMENT names
KIND_KEY = "pdserve-error"  # trailing metadata: which of the errors sharing a code this is
UNKNOWN_PEER = "unknown-peer"
UNKNOWN_LORA = "unknown-lora"
# Details travel in a trailer, which grpc refuses past 16 KiB: an error naming a huge request id
# would reach the client as RESOURCE_EXHAUSTED (a retryable overload) instead of itself.
MAX_DETAILS_CHARS = 1024

_CODES: tuple[tuple[type[PdserveError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (UnknownRequestError, grpc.StatusCode.NOT_FOUND),
    (UnknownLoraAdapterError, grpc.StatusCode.NOT_FOUND),
    (OutOfBlocksError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineWedgedError, grpc.StatusCode.UNAVAILABLE),
    (WorkerDrainingError, grpc.StatusCode.UNAVAILABLE),
    (WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (IncompatiblePeerError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownPeerError, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (TransferError, grpc.StatusCode.ABORTED),
)

Metadata = tuple[tuple[str, str], ...]


def status_of(exc: PdserveError) -> tuple[grpc.StatusCode, str, Metadata]:
    """The code, details (at most `MAX_DETAILS_CHARS`) and trailing metadata a worker answers `exc` with."""
    code = next((c for kind, c in _CODES if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)
    details = str(exc)
    if len(details) > MAX_DETAILS_CHARS:
        details = details[: MAX_DETAILS_CHARS - 3] + "..."
    if isinstance(exc, InvalidRequestError) and exc.param is not None:
        return code, details, ((PARAM_KEY, exc.param[:MAX_DETAILS_CHARS]),)
    if isinstance(exc, UnknownPeerError):
        return code, details, ((KIND_KEY, UNKNOWN_PEER),)
    if isinstance(exc, UnknownLoraAdapterError):
        return code, details, ((KIND_KEY, UNKNOWN_LORA),)
    return code, details, ()


def error_from_status(
    code: grpc.StatusCode, details: str, metadata: Metadata, address: str, timeout_s: float
) -> PdserveError:
    """The typed error a client raises for a call to `address` that ended with `code`.

    `timeout_s` is the deadline the call ran under, named in a WorkerTimeoutError.
    """
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return WorkerTimeoutError(address, timeout_s)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return WorkerUnavailableError(address, details or code.name)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # overloaded: a retryable 503, like unavailable
        return WorkerUnavailableError(address, f"overloaded: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details, dict(metadata).get(PARAM_KEY))
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return DuplicateRequestError(details)
    if code == grpc.StatusCode.NOT_FOUND and dict(metadata).get(KIND_KEY) == UNKNOWN_LORA:
        return UnknownLoraAdapterError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownRequestError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION and dict(metadata).get(KIND_KEY) == UNKNOWN_PEER:
        return UnknownPeerError(f"{address}: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return IncompatiblePeerError(f"{address}: {details}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDeniedError(f"{address}: {details}")
    if code == grpc.StatusCode.ABORTED:
        return TransferError(f"{address}: {details}")
    return WorkerError(f"worker {address} failed: {code.name}: {details}")


def error_from_rpc(err: grpc.aio.AioRpcError, address: str, timeout_s: float) -> PdserveError:
    """`error_from_status` for a failed grpc.aio call."""
    metadata = tuple((k, v) for k, v in (err.trailing_metadata() or ()) if isinstance(v, str))
    return error_from_status(err.code(), err.details() or "", metadata, address, timeout_s)
