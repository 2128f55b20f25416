"""The engine thread's inbox: what the event loops send it, taken in order between steps.

The commands are typed: admissions, aborts and `Query` of one `Op`s, never a callable. While a
step waits for a core a peer still uses (`core_share.py`), the thread takes queries and aborts but stops at the first admission, which it holds and takes first after the step:
commands keep their order, and requests admitted meanwhile join the step they always did.
"""
import asyncio
import enum
import queue
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.kvcache import ClaimResult


@dataclass(slots=True)
class Stream:
    """Where a request's outputs go: a queue on its caller's event loop, or, once its reader has
    taken the first, `direct` (see `common.engine_api.OUTPUT_SINK`; set and read on that loop)."""
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    num_completions: int
    num_finished: int = 0
    direct: Callable[[RequestOutput], bool] | None = None


@dataclass(frozen=True, slots=True)
class Admit:
    """Queue a request; `admitted` gets None, or the typed error that refused it."""
    request: GenerationRequest
    stream: Stream
    admitted: asyncio.Future
    prefill_only: bool
    hold_lease_s: float
    arrival_s: float
    start_by: float | None = None  # time.monotonic(): see LLMEngine.add_request


@dataclass(frozen=True, slots=True)
class DecodeVerdict:
    """Where a decode worker's request is prefilled: `claim` set for a remote prefill into the
    reserved blocks, else `local_reason` (the request is queued here already)."""
    claim: ClaimResult | None
    local_reason: str | None


@dataclass(frozen=True, slots=True)
class AdmitForDecode:
    """Decode side, in one hop: reserve blocks for a remote prefill, or queue the request here.
    `verdict` gets a DecodeVerdict, or the typed error that refused the request."""
    request: GenerationRequest
    stream: Stream
    verdict: asyncio.Future
    remote_possible: bool
    min_remote_tokens: int
    lease_s: float
    arrival_s: float


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: RequestId


class Op(enum.Enum):
    """What else the engine thread does between steps, for the worker's parts: a closed set (no
    callable reaches the thread), each answered with its result or typed error."""
    PING = "ping"  # nothing: the watchdog's proof that the thread takes commands
    COMPLETE_REMOTE = "complete_remote"  # (request id, first token, logprob, skipped slices): engine.remote.complete
    FAIL_REMOTE = "fail_remote"  # (request id, recompute, reason): engine.remote.fail
    RELEASE_HELD = "release_held"  # (request id,): engine.remote.release_held
    ADD_LORA = "add_lora"  # (LoraCheckpoint,)
    REMOVE_LORA = "remove_lora"  # (lora id,)
    CHECK_INTEGRITY = "check_integrity"  # (): a KvIntegrity
    KV_SNAPSHOT = "kv_snapshot"  # (): (next event seq, every cached block with its tier)
    SPILL_HOST_TIER = "spill_host_tier"  # (): how many host-tier blocks were written to disk


@dataclass(frozen=True, slots=True)
class Query:
    """Do `op` with `args` between steps; `done` gets its value or typed error. RequestOutputs in
    a returned list are also delivered to their streams."""
    op: Op
    args: tuple
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


Command = Admit | AdmitForDecode | Abort | Query


class Inbox:
    """Written from any thread, read by the engine thread alone."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: Admit | AdmitForDecode | None = None  # taken out, handed out first next time

    def put(self, command: Command) -> None:
        self._queue.put(command)

    def take(self, until_admission: bool = False) -> Command | None:
        """The next command; None when there is none, or (`until_admission`) when it is an admission."""
        if self._held is not None:
            command, self._held = self._held, None
        else:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return None
        if until_admission and isinstance(command, (Admit, AdmitForDecode)):
            self._held = command
            return None
        return command
