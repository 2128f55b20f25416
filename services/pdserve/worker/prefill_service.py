"""The prefill worker's KvTransfer service: handshakes, and prefill orders that end in a KV push.

A prefill order runs the prompt as a prefill-only request (the engine holds its blocks after
the first token), WRITEs the blocks the decode worker lacks into the blocks it reserved, and
answers once every byte has landed. A block out of some window layers' reach from the decode
worker's first query on travels without their slices (`kvcache/windows.py`, from the layer
windows both sides agreed on at the handshake); the decode worker leaves the same ones out.
An order from a decode worker we have no handshake with (we restarted since) is refused before
any compute, so the decode worker re-handshakes and retries; so is an order without a valid
write grant (`write_grants.py`), a replayed one (a nonce seen before), and a handshake from a
worker of another deployment.

An order names two absolute times (Unix seconds, signed in its grant): the prefill must start
by `start_by` (a request still queued then ends unstarted: the queue wait is bounded), and no
byte may land after `deadline`, which the decode worker's lease outlasts. The deadline is read
at the moment of writing: a write whose budget has run out while it waited for a thread or the
transport is never posted, and one under way fails at the deadline. The write runs on a worker
thread (NIXL's calls block for the copy; the event loop keeps serving gRPC). The held blocks
are released as soon as no transfer can read them any more, after the reply rather than
before it; a transfer that cannot be stopped leaves them to the hold's lease.
"""
import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
import contextlib
from contextlib import AbstractAsyncContextManager, aclosing

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
from pdserve.common.ids import BlockId, RequestId, WorkerId
from pdserve.kvcache.windows import SkippedSlices
from pdserve.transfer.interface import KvTransport
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.metrics import TransferMetrics
from pdserve.worker.kv.write_grants import is_granted

log = logging.getLogger(__name__)
MAX_ORDER_TIMEOUT_S = 600.0  # the longest a prefill worker holds blocks for a peer
MAX_NONCE_BYTES = 64


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
        self._nonces: dict[bytes, float] = {}  # nonces of granted orders -> their deadline (time.monotonic())
        # What an order passes first, as a Generate stream does (`admission.entry_of`: drain gate,
        # wedge check, waiting bound); set once the worker's gate exists. None: nothing.
        self.entry: Callable[[], AbstractAsyncContextManager] = contextlib.nullcontext
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
            async with self.entry():
                result = await self._prefill(order)
        except PdserveError:
            self._metrics.failures.labels("sent").inc()
            raise
        self._metrics.transferred("sent", result.num_blocks, result.num_bytes)
        return result

    async def _prefill(self, order: PrefillOrder) -> PrefillResult:
        start_by, deadline = _local_times(order)
        if not self._transport.has_peer(order.decode_worker_id):
            raise UnknownPeerError(f"no KV handshake with decode worker {order.decode_worker_id!r}: handshake again")
        if not is_granted(self._order_keys.get(order.decode_worker_id), order):
            raise PermissionDeniedError(f"order for {order.request.request_id!r} carries no valid write grant of "
                                        f"{order.decode_worker_id!r}")
        self._check_fresh(order, deadline)
        lora_id = order.request.lora_id
        if lora_id is not None and lora_id not in self._lora_ids():
            raise IncompatiblePeerError(f"LoRA adapter {lora_id} of {order.request.request_id!r} is not loaded on "
                                        "this prefill worker: its KV would be another model's")
        first = await self._first_output(order, start_by, deadline)
        request_id = order.request.request_id
        transfer: asyncio.Future | None = None
        try:
            held = first.held_block_ids  # the engine may be inside its next step already
            source = list(held[order.first_block:order.first_block + len(order.dest_block_ids)])
            if len(source) != len(order.dest_block_ids):
                raise InvalidRequestError(
                    f"prompt has {len(held)} blocks; cannot send {len(order.dest_block_ids)} from block "
                    f"{order.first_block}", "dest_block_ids")
            spec = self._transport.spec
            skipped = spec.windows.skipped(len(order.request.prompt_token_ids), order.first_block, len(source))
            started = time.perf_counter()
            transfer = asyncio.ensure_future(asyncio.to_thread(self._write, order, source, skipped, deadline))
            await asyncio.shield(transfer)  # a call cancelled mid-write leaves the write to finish or stop
            self._metrics.transfer_seconds.observe(time.perf_counter() - started)
        finally:
            self._release_when_settled(request_id, transfer)
        self._metrics.left_behind("sent", skipped, spec.bytes_per_layer)
        num_bytes = len(source) * spec.bytes_per_block - sum(len(s.layers) for s in skipped) * spec.bytes_per_layer
        logprob = first.logprobs[0] if first.logprobs else None
        return PrefillResult(first.token_ids[0], logprob, first.num_cached_tokens, len(source), num_bytes)

    def _check_fresh(self, order: PrefillOrder, deadline: float) -> None:
        """Refuse a replayed order; remember this one's nonce until its deadline has passed (a
        replay after that is refused as late)."""
        now = time.monotonic()
        for nonce in [n for n, until in self._nonces.items() if until < now]:
            del self._nonces[nonce]
        if not order.nonce or len(order.nonce) > MAX_NONCE_BYTES:
            raise PermissionDeniedError(f"order for {order.request.request_id!r} carries no nonce "
                                        f"(1 to {MAX_NONCE_BYTES} bytes)")
        if order.nonce in self._nonces:
            raise PermissionDeniedError(f"order for {order.request.request_id!r} was sent before (a replayed nonce)")
        self._nonces[order.nonce] = deadline

    def _write(self, order: PrefillOrder, source: list, skipped: Sequence[SkippedSlices], deadline: float) -> None:
        """On a worker thread: NIXL's post and progress calls may block for a whole copy, and the
        event loop keeps serving gRPC meanwhile. The budget is what is left of `deadline`
        (time.monotonic()) now, after the wait for this thread. Raises _Unstoppable when the
        write may still run."""
        timeout_s = deadline - time.monotonic()
        if timeout_s <= 0:
            raise TransferError(f"deadline passed before writing {order.request.request_id!r}")
        local, remote, layers = slices_to_send(source, order.dest_block_ids, order.first_block, skipped,
                                               self._transport.spec.num_layers)
        if skipped and not local:  # every layer has a window, and no block is within reach
            return
        handle = self._transport.write_blocks(order.decode_worker_id, local, remote, b"", timeout_s, layers)
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
            task = asyncio.ensure_future(self._engine.release_held(request_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

        if transfer is None or transfer.done():
            release(transfer)
        else:
            transfer.add_done_callback(release)

    async def _first_output(self, order: PrefillOrder, start_by: float, deadline: float):
        first = None
        hold_lease_s = deadline - time.monotonic()
        async with aclosing(self._engine.generate(order.request, prefill_only=True, hold_lease_s=hold_lease_s,
                                                  start_by=start_by)) as outputs:
            async for output in outputs:
                first = output
        if first is None or first.finish_reason in ("abort", "error") or not first.token_ids:
            raise WorkerError(f"prefill of {order.request.request_id!r} failed: "
                              f"{first.error if first else 'no output'}")
        return first


def slices_to_send(source: Sequence[BlockId], dest: Sequence[BlockId], first_block: int,
                   skipped: Sequence[SkippedSlices], num_layers: int) -> tuple[list, list, list | None]:
    """(our blocks, the peer's, each pair's layers or None: whole blocks) of a hand-off of prompt
    blocks from `first_block`, leaving `skipped` behind; a block with no layer left is not named."""
    if not skipped:
        return list(source), list(dest), None
    left = {s.block_index - first_block: set(s.layers) for s in skipped}
    kept = [(src, dst, [layer for layer in range(num_layers) if layer not in left.get(i, ())])
            for i, (src, dst) in enumerate(zip(source, dest))]
    kept = [pair for pair in kept if pair[2]]
    layers = [p[2] for p in kept]
    is_whole = all(len(pair_layers) == num_layers for pair_layers in layers)  # the prepared descriptors serve
    return [p[0] for p in kept], [p[1] for p in kept], None if is_whole else layers


def _local_times(order: PrefillOrder) -> tuple[float, float]:
    """The order's start-by time and deadline on time.monotonic()'s clock; InvalidRequestError
    (nothing computed) for a deadline that has passed, is not finite, or lies more than
    MAX_ORDER_TIMEOUT_S ahead, and for a start-by time after the deadline."""
    wall, now = time.time(), time.monotonic()
    remaining = order.deadline - wall
    if not (math.isfinite(remaining) and 0 < remaining <= MAX_ORDER_TIMEOUT_S):  # the hold's lease too
        why = "has passed" if remaining <= 0 else f"must be at most {MAX_ORDER_TIMEOUT_S:g} seconds ahead"
        raise InvalidRequestError(f"deadline={order.deadline!r} {why} (now {wall:.3f})", "deadline")
    start_in = order.latest_start - wall
    if not (math.isfinite(start_in) and start_in <= remaining):
        raise InvalidRequestError(f"start_by={order.start_by!r}: must not be after the deadline", "start_by")
    return now + start_in, now + remaining


class _Unstoppable(TransferError):
    """A write that failed and could not be stopped: its source blocks may still be read."""
