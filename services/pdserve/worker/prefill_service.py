"""The prefill worker's KvTransfer service: handshakes, and prefill orders that end in a KV push.

A prefill order runs the prompt as a prefill-only request (the engine holds its blocks after
the first token), WRITEs the blocks the decode worker lacks into the blocks it reserved, and
answers once every byte has landed. An order from a decode worker we have no handshake with
(we restarted since) is refused before any compute, so the decode worker re-handshakes and
retries; so is an order without a valid write grant (`write_grants.py`), and a handshake from a
worker of another deployment. The write runs on a worker thread (NIXL's calls block for the copy; the event loop
keeps serving gRPC) and never starts after the order's deadline, so the decode worker's lease
(longer) covers it. The held blocks are released as soon as no transfer can read them any
more, after the reply rather than before it; a transfer that cannot be stopped leaves them to
the hold's lease.
"""
import asyncio
import logging
import math
import time
from collections.abc import Callable
from contextlib import aclosing

from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.errors import (
    IncompatiblePeerError,
    InvalidRequestError,
    PdserveError,
    PermissionDeniedError,
    TransferError,
    UnknownPeerError,
    WorkerError,
)
from pdserve.common.ids import RequestId, WorkerId
from pdserve.transfer.interface import KvTransport
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.metrics import TransferMetrics
from pdserve.worker.kv.write_grants import is_granted

log = logging.getLogger(__name__)
MAX_ORDER_TIMEOUT_S = 600.0  # the longest a prefill worker holds blocks for a peer


class PrefillService:
    """The prefill worker's `rpc.kv_transfer_service.KvTransferHandler`."""

    def __init__(self, engine: ThreadedEngine, transport: KvTransport, metrics: TransferMetrics,
                 deployment_id: str = "", lora_ids: Callable[[], frozenset[int]] = frozenset) -> None:
        self._engine = engine
        self._lora_ids = lora_ids  # the LoRA adapters we hold now
        self._transport = transport
        self._metrics = metrics
        self._deployment_id = deployment_id
        self._order_keys: dict[WorkerId, bytes] = {}  # each peer's key of its write grants
        self._releases: set[asyncio.Task] = set()

    async def handshake(self, hello: Hello) -> Hello:
        try:
            if hello.deployment_id != self._deployment_id:
                raise PermissionDeniedError(f"worker {hello.worker_id!r} belongs to deployment "
                                            f"{hello.deployment_id!r}, not {self._deployment_id!r}")
            if not hello.order_key:
                raise PermissionDeniedError(f"worker {hello.worker_id!r} sent no write-grant key")
            await asyncio.to_thread(self._transport.add_peer, hello.worker_id, hello.metadata)
        except PdserveError as exc:
            log.error("refused KV peer %s: %s", hello.worker_id, exc)
            raise
        self._order_keys[hello.worker_id] = hello.order_key
        ours = self._lora_ids()
        if hello.lora_ids != ours:
            log.warning("KV peer %s holds other LoRA adapters (%d of its %d are not ours): prompts under those "
                        "are prefilled on it", hello.worker_id, len(hello.lora_ids - ours), len(hello.lora_ids))
        return Hello(self._transport.worker_id, self._transport.local_metadata(), self._deployment_id,
                     lora_ids=ours)

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        try:
            result = await self._prefill(order)
        except PdserveError:
            self._metrics.failures.labels("sent").inc()
            raise
        self._metrics.transferred("sent", result.num_blocks, result.num_bytes)
        return result

    async def _prefill(self, order: PrefillOrder) -> PrefillResult:
        if not (math.isfinite(order.timeout_s) and 0 < order.timeout_s <= MAX_ORDER_TIMEOUT_S):  # the hold's lease too
            raise InvalidRequestError(f"timeout_s={order.timeout_s!r}: must be more than 0 and at most "
                                      f"{MAX_ORDER_TIMEOUT_S:g} seconds", "timeout_s")
        deadline = time.monotonic() + order.timeout_s
        if not self._transport.has_peer(order.decode_worker_id):
            raise UnknownPeerError(f"no KV handshake with decode worker {order.decode_worker_id!r}: handshake again")
        if not is_granted(self._order_keys.get(order.decode_worker_id), order):
            raise PermissionDeniedError(f"order for {order.request.request_id!r} carries no valid write grant of "
                                        f"{order.decode_worker_id!r}")
        lora_id = order.request.lora_id
        if lora_id is not None and lora_id not in self._lora_ids():
            raise IncompatiblePeerError(f"LoRA adapter {lora_id} of {order.request.request_id!r} is not loaded on "
                                        "this prefill worker: its KV would be another model's")
        first = await self._first_output(order)
        request_id = order.request.request_id
        transfer: asyncio.Future | None = None
        try:
            held = first.held_block_ids  # the engine may be inside its next step already
            source = list(held[order.first_block:order.first_block + len(order.dest_block_ids)])
            if len(source) != len(order.dest_block_ids):
                raise InvalidRequestError(
                    f"prompt has {len(held)} blocks; cannot send {len(order.dest_block_ids)} from block "
                    f"{order.first_block}", "dest_block_ids")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(f"deadline passed before writing {request_id!r}")
            started = time.perf_counter()
            transfer = asyncio.ensure_future(asyncio.to_thread(self._write, order, source, remaining))
            await asyncio.shield(transfer)  # a call cancelled mid-write leaves the write to finish or stop
            self._metrics.transfer_seconds.observe(time.perf_counter() - started)
        finally:
            self._release_when_settled(request_id, transfer)
        num_bytes = len(source) * self._transport.spec.bytes_per_block
        logprob = first.logprobs[0] if first.logprobs else None
        return PrefillResult(first.token_ids[0], logprob, first.num_cached_tokens, len(source), num_bytes)

    def _write(self, order: PrefillOrder, source: list, timeout_s: float) -> None:
        """On a worker thread: NIXL's post and progress calls may block for a whole copy, and the
        event loop keeps serving gRPC meanwhile. Raises _Unstoppable when the write may still run."""
        handle = self._transport.write_blocks(order.decode_worker_id, source, order.dest_block_ids, b"", timeout_s)
        try:
            self._transport.wait(handle)
        finally:
            try:
                self._transport.release(handle)
            except TransferError as exc:
                raise _Unstoppable(f"write of {order.request.request_id!r} could not be stopped: {exc}") from exc

    def _release_when_settled(self, request_id: RequestId, transfer: asyncio.Future | None) -> None:
        """Free the held blocks once no write can read them, without delaying the reply (the
        engine takes the call between steps). An unstoppable write leaves them to the lease."""
        def release(done: asyncio.Future | None) -> None:
            if done is not None and not done.cancelled() and isinstance(done.exception(), _Unstoppable):
                log.warning("keeping the blocks of %s until their lease: %s", request_id, done.exception())
                return
            task = asyncio.ensure_future(self._engine.call(self._engine.engine.release_held, request_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

        if transfer is None or transfer.done():
            release(transfer)
        else:
            transfer.add_done_callback(release)

    async def _first_output(self, order: PrefillOrder):
        first = None
        async with aclosing(self._engine.generate(order.request, prefill_only=True,
                                                  hold_lease_s=order.timeout_s)) as outputs:
            async for output in outputs:
                first = output
        if first is None or first.finish_reason in ("abort", "error") or not first.token_ids:
            raise WorkerError(f"prefill of {order.request.request_id!r} failed: "
                              f"{first.error if first else 'no output'}")
        return first


class _Unstoppable(TransferError):
    """A write that failed and could not be stopped: its source blocks may still be read."""
