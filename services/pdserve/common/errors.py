"""Typed errors. Each maps to one HTTP status / gRPC code at the process edge."""


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class ConfigError(PdserveError, ValueError):
    """A configuration value is invalid. Names the field and the value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


class InvalidRequestError(PdserveError, ValueError):
    """A request is malformed or out of range (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownRequestError(PdserveError, KeyError):
    """An operation names a request the manager does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class UnknownLoraAdapterError(PdserveError, LookupError):
    """A request or an unload names a LoRA adapter that is not loaded (HTTP 404)."""


class DuplicateRequestError(PdserveError, ValueError):
    """A request id is already held."""


class OutOfBlocksError(PdserveError):
    """Not enough free or evictable blocks; nothing was changed."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"need {needed} blocks, only {available} free or evictable")
        self.needed = needed
        self.available = available


class TransferError(PdserveError):
    """Moving KV blocks between workers failed or timed out."""


class IncompatiblePeerError(TransferError):
    """A peer's KV layout does not match ours; no bytes were moved."""


class UnknownPeerError(TransferError):
    """A prefill order names a decode worker this prefill worker has no handshake with (it
    restarted since): refused before computing anything, so no bytes were moved."""


class PermissionDeniedError(TransferError):
    """A call the caller's identity does not allow: a method its certificate's role may not
    call (`rpc/access.py`), a handshake claiming another worker's id, a write order for blocks
    the caller did not reserve, or a peer of another deployment. Refused before anything
    changes (gRPC PERMISSION_DENIED)."""


class WorkerUnavailableError(PdserveError):
    """A worker cannot be reached, or is shutting down (HTTP 503)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"worker {address} unavailable: {reason}")
        self.address = address
        self.reason = reason


class WorkerTimeoutError(PdserveError, TimeoutError):
    """A call to a worker ran past its deadline (HTTP 504); the worker aborted the request."""

    def __init__(self, address: str, timeout_s: float) -> None:
        super().__init__(f"worker {address} did not answer within {timeout_s:g} s")
        self.address = address
        self.timeout_s = timeout_s


class WorkerError(PdserveError):
    """A worker failed a request for a reason of its own (HTTP 500)."""


class OverloadedError(PdserveError):
    """A bound on waiting requests is reached: refused at once, never queued without end
    (gRPC RESOURCE_EXHAUSTED; HTTP 503 with Retry-After)."""


class EngineWedgedError(PdserveError):
    """The engine thread has not come back from a step (or call) within its deadline while work
    waits for it: the worker cannot serve (gRPC UNAVAILABLE; health NOT_SERVING)."""


class WorkerDrainingError(PdserveError):
    """The worker is shutting down: it finishes the requests it runs and refuses new ones
    (gRPC UNAVAILABLE, so the router routes elsewhere; health NOT_SERVING)."""
