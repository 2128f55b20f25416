"""The decode worker's engine: prompts prefilled by a prefill worker, tokens decoded here.

    generate(request, prefill_worker, prefill_worker_id)
      local prefill when: no prefill worker, n > 1, prompt logprobs asked for (they come from
                          the prompt's logits), few tokens missing from our own cache,
                          the peer cannot be reached, it does not hold the request's LoRA
                          adapter (told at handshake; `lora_mismatch`), `max_prefill_queue`
                          of our orders to it have not been answered yet (`prefill_queue_full`:
                          a burst is shared with our own cores rather than queued there
                          until it times out), or no blocks are free
      else: reserve blocks (two-phase claim; our cached prefix is reused)
            → the prefill worker computes the prompt and WRITEs only the blocks we lack, without
              the window layers' slices no query from here on reaches (`kvcache/windows.py`)
            → those slices are zeroed and their blocks marked for our cache, the first token is
              emitted here and decoding continues in our batch

Every wait is bounded. An order must start within `prefill_queue_timeout_s` (`start_by`) and
land by `deadline`, `transfer_timeout_s` later: both absolute, fixed once before the blocks are
reserved, signed in the order's grant and kept by a retry. The reserved blocks' lease is set
then too, `lease_grace_s` past the deadline, so no write the prefill worker accepts can land
after it, and the engine frees them when it ends.

A reserved block may receive a write until the prefill call has answered: the call therefore
runs to its end even when the client goes away (the answer frees the blocks at once: success
means every byte has landed), and a failed call leaves the blocks to the engine's quarantine
until the lease ends. A prefill worker that answers "unknown peer" (it restarted) has computed
and written nothing: we handshake again and retry once on the same blocks, by the same deadline.
"""
import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from pdserve.common.disagg import PrefillOrder, PrefillResult
from pdserve.common.errors import PdserveError, TransferError, UnknownPeerError, WorkerUnavailableError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo
from pdserve.kvcache import ClaimResult
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.kv.peers import PrefillPeer, PrefillPeers
from pdserve.worker.kv.write_grants import new_nonce
from pdserve.worker.metrics import TransferMetrics

log = logging.getLogger(__name__)
LOCAL = "local"  # RequestOutput.prefilled_by when this worker computed the prompt


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    worker_id: WorkerId
    min_remote_prefill_tokens: int = 32
    transfer_timeout_s: float = 30.0  # from the latest start of the peer's prefill to its last byte
    lease_grace_s: float = 10.0
    recompute_on_failure: bool = True
    prefill_queue_timeout_s: float = 30.0  # how long an order may wait in the peer's queue
    max_prefill_queue: int = 8  # our unanswered orders to one peer; more prefill here


class DecodeEngine:
    """Implements `worker.engine_api.AsyncEngine` for role=decode."""

    def __init__(self, engine: ThreadedEngine, peers: PrefillPeers, config: DisaggConfig,
                 metrics: TransferMetrics) -> None:
        self._engine = engine
        self._peers = peers
        self._config = config
        self._metrics = metrics
        self._prefills: set[asyncio.Task] = set()  # remote prefills, kept to their end
        self._queued: Counter[str] = Counter()  # our unanswered orders, by prefill worker address

    def info(self) -> ModelInfo:
        return self._engine.info()

    def stats(self) -> EngineStats:
        return self._engine.stats()

    async def abort(self, request_id: RequestId) -> None:
        await self._engine.abort(request_id)

    async def check_integrity(self) -> KvIntegrity:
        return await self._engine.check_integrity()

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        peer, reason = await self._peer(request, prefill_worker, prefill_worker_id)
        config = self._config
        start_by = time.time() + config.prefill_queue_timeout_s
        deadline = start_by + config.transfer_timeout_s
        lease_s = deadline - time.time() + config.lease_grace_s  # it starts later, at the reservation
        try:
            verdict, stream = await self._engine.admit_for_decode(request, peer is not None,
                                                                 config.min_remote_prefill_tokens, lease_s)
        except BaseException:
            self._unqueue(peer and peer.address)
            raise
        prefilled_by = LOCAL
        if verdict.claim is None:
            self._unqueue(peer and peer.address)
            self._metrics.local_prefills.labels(reason or verdict.local_reason).inc()
        else:
            first_block = verdict.claim.num_cached_tokens // self._engine.engine.kv.tokens_per_block
            order = PrefillOrder(request, config.worker_id, first_block, verdict.claim.block_ids[first_block:],
                                 deadline, start_by, new_nonce())
            prefill = asyncio.ensure_future(self._remote_prefill(peer, order))
            self._prefills.add(prefill)
            prefill.add_done_callback(self._prefills.discard)
            try:
                # a client that leaves does not cut the call short
                prefilled_by = peer.address if await asyncio.shield(prefill) else LOCAL
            except BaseException:
                await asyncio.shield(self._engine.abort(request.request_id))
                raise
        is_first = True
        async for output in self._engine.outputs(request, stream):
            yield replace(output, prefilled_by=prefilled_by) if is_first else output
            is_first = False

    def _unqueue(self, address: str | None) -> None:
        """One order fewer waiting on the prefill worker at `address` (None: none was counted)."""
        if address is not None:
            self._queued[address] -= 1
            if self._queued[address] <= 0:
                del self._queued[address]

    async def _peer(self, request: GenerationRequest, prefill_worker: str | None,
                    prefill_worker_id: WorkerId | None = None) -> tuple[PrefillPeer | None, str | None]:
        """The prefill worker to use (at `prefill_worker`, the one of `prefill_worker_id` when
        given: `PrefillPeers.get`), or None and why the prompt is prefilled here."""
        reason = self._local_reason(request, prefill_worker)
        if reason is not None:
            return None, reason
        try:
            peer = await self._peers.get(prefill_worker, prefill_worker_id)
            if request.lora_id is None or request.lora_id in peer.lora_ids:
                return self._queue_on(peer)
            if peer.our_lora_ids != self._peers.lora_ids():  # our adapters changed since: so may its
                await self._peers.forget(peer)
                peer = await self._peers.get(prefill_worker, prefill_worker_id)
        except PdserveError as exc:
            log.warning("prefill worker %s unusable, prefilling locally: %s", prefill_worker, exc)
            return None, "peer_unavailable"
        if request.lora_id in peer.lora_ids:
            return self._queue_on(peer)
        log.info("prefill worker %s does not hold LoRA adapter %d of %s: prefilling locally", prefill_worker,
                 request.lora_id, request.request_id)
        return None, "lora_mismatch"

    def _queue_on(self, peer: PrefillPeer) -> tuple[PrefillPeer | None, str | None]:
        """`peer`, counting one more order to it, unless `max_prefill_queue` of ours wait there."""
        if self._queued[peer.address] >= self._config.max_prefill_queue:
            return None, "prefill_queue_full"
        self._queued[peer.address] += 1
        return peer, None

    @staticmethod
    def _local_reason(request: GenerationRequest, prefill_worker: str | None) -> str | None:
        if prefill_worker is None:
            return "no_prefill_worker"
        if request.sampling.n > 1:
            return "n_gt_1"
        if request.sampling.prompt_logprobs is not None:  # computed from the prompt's logits, here
            return "prompt_logprobs"
        return None

    async def _remote_prefill(self, peer: PrefillPeer, order: PrefillOrder) -> bool:
        """True once the prompt's KV has landed; False when it is recomputed here (or failed)."""
        request = order.request
        address = peer.address
        start = time.perf_counter()
        try:
            try:
                result = await _send(peer, order)
            except UnknownPeerError as exc:
                log.info("prefill worker at %s does not know us (%s): handshaking again", peer.address, exc)
                await self._peers.forget(peer)
                peer = await self._peers.get(peer.address, peer.identity)
                result = await _send(peer, order)
        except PdserveError as exc:
            log.warning("KV transfer for %s from %s failed: %s", request.request_id, peer.address, exc)
            self._metrics.failures.labels("received").inc()
            if isinstance(exc, (WorkerUnavailableError, UnknownPeerError)):
                await self._peers.forget(peer)
            await self._engine.fail_remote(request.request_id, self._config.recompute_on_failure,
                                           f"KV transfer from {peer.address} failed: {exc}")
            return False
        finally:
            self._unqueue(address)
        spec = self._peers.layout  # the peer skipped the same slices: it agreed to these windows
        skipped = spec.windows.skipped(len(request.prompt_token_ids), order.first_block, len(order.dest_block_ids))
        self._metrics.transferred("received", result.num_blocks, result.num_bytes)
        self._metrics.left_behind("received", skipped, spec.bytes_per_layer)
        self._metrics.remote_prefill_seconds.observe(time.perf_counter() - start)
        await self._engine.complete_remote(request.request_id, result.first_token, result.logprob, skipped)
        return True


async def _send(peer: PrefillPeer, order: PrefillOrder) -> PrefillResult:
    """`order` to `peer`, waiting for its answer until a second past its deadline; not sent once
    the deadline has passed (the peer would refuse it)."""
    left_s = order.deadline - time.time()
    if left_s <= 0:
        raise TransferError(f"the deadline of {order.request.request_id!r} passed before its order could be sent")
    return await peer.prefill(order, left_s + 1.0)
