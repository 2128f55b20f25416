"""The decode worker's engine: prompts prefilled by a prefill worker, tokens decoded here.

    generate(request, prefill_worker)
      local prefill when: no prefill worker, n > 1, prompt logprobs asked for (they come from
                          the prompt's logits), few tokens missing from our own cache,
                          the peer cannot be reached, it does not hold the request's LoRA
                          adapter (told at handshake; `lora_mismatch`), or no blocks are free
      else: reserve blocks (two-phase claim; our cached prefix is reused)
            → the prefill worker computes the prompt and WRITEs only the blocks we lack
            → its first token is emitted here and decoding continues in our batch

Every wait is bounded: the prefill call by `transfer_timeout_s`, the reserved blocks by a
lease of `transfer_timeout_s + lease_grace_s`, after which the engine frees them.

A reserved block may receive a write until the prefill call has answered: the call therefore
runs to its end even when the client goes away (the answer frees the blocks at once: success
means every byte has landed), and a failed call leaves the blocks to the engine's quarantine
until the lease ends. A prefill worker that answers "unknown peer" (it restarted) has computed
and written nothing: we handshake again and retry once on the same blocks.
"""
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from pdserve.common.disagg import PrefillOrder
from pdserve.common.errors import PdserveError, UnknownPeerError, WorkerUnavailableError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo
from pdserve.kvcache import ClaimResult
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.kv.peers import PrefillPeer, PrefillPeers
from pdserve.worker.metrics import TransferMetrics

log = logging.getLogger(__name__)
LOCAL = "local"  # RequestOutput.prefilled_by when this worker computed the prompt


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    worker_id: WorkerId
    min_remote_prefill_tokens: int = 32
    transfer_timeout_s: float = 30.0
    lease_grace_s: float = 10.0
    recompute_on_failure: bool = True


class DecodeEngine:
    """Implements `worker.engine_api.AsyncEngine` for role=decode."""

    def __init__(self, engine: ThreadedEngine, peers: PrefillPeers, config: DisaggConfig,
                 metrics: TransferMetrics) -> None:
        self._engine = engine
        self._peers = peers
        self._config = config
        self._metrics = metrics
        self._prefills: set[asyncio.Task] = set()  # remote prefills, kept to their end

    def info(self) -> ModelInfo:
        return self._engine.info()

    def stats(self) -> EngineStats:
        return self._engine.stats()

    async def abort(self, request_id: RequestId) -> None:
        await self._engine.abort(request_id)

    async def check_integrity(self) -> KvIntegrity:
        return await self._engine.check_integrity()

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None) -> AsyncIterator[RequestOutput]:
        peer, reason = await self._peer(request, prefill_worker)
        lease_s = self._config.transfer_timeout_s + self._config.lease_grace_s
        verdict, queue = await self._engine.admit_for_decode(request, peer is not None,
                                                             self._config.min_remote_prefill_tokens, lease_s)
        prefilled_by = LOCAL
        if verdict.claim is None:
            self._metrics.local_prefills.labels(reason or verdict.local_reason).inc()
        else:
            prefill = asyncio.ensure_future(self._remote_prefill(peer, request, verdict.claim))
            self._prefills.add(prefill)
            prefill.add_done_callback(self._prefills.discard)
            try:
                # a client that leaves does not cut the call short
                prefilled_by = peer.address if await asyncio.shield(prefill) else LOCAL
            except BaseException:
                await asyncio.shield(self._engine.abort(request.request_id))
                raise
        is_first = True
        async for output in self._engine.outputs(request, queue):
            yield replace(output, prefilled_by=prefilled_by) if is_first else output
            is_first = False

    async def _peer(self, request: GenerationRequest, prefill_worker: str | None) -> tuple[PrefillPeer | None, str | None]:
        """The prefill worker to use, or None and why the prompt is prefilled here."""
        reason = self._local_reason(request, prefill_worker)
        if reason is not None:
            return None, reason
        try:
            peer = await self._peers.get(prefill_worker)
            if request.lora_id is None or request.lora_id in peer.lora_ids:
                return peer, None
            if peer.our_lora_ids != self._peers.lora_ids():  # our adapters changed since: so may its
                await self._peers.forget(peer)
                peer = await self._peers.get(prefill_worker)
        except PdserveError as exc:
            log.warning("prefill worker %s unusable, prefilling locally: %s", prefill_worker, exc)
            return None, "peer_unavailable"
        if request.lora_id in peer.lora_ids:
            return peer, None
        log.info("prefill worker %s does not hold LoRA adapter %d of %s: prefilling locally", prefill_worker,
                 request.lora_id, request.request_id)
        return None, "lora_mismatch"

    @staticmethod
    def _local_reason(request: GenerationRequest, prefill_worker: str | None) -> str | None:
        if prefill_worker is None:
            return "no_prefill_worker"
        if request.sampling.n > 1:
            return "n_gt_1"
        if request.sampling.prompt_logprobs is not None:  # computed from the prompt's logits, here
            return "prompt_logprobs"
        return None

    async def _remote_prefill(self, peer: PrefillPeer, request: GenerationRequest, claim: ClaimResult) -> bool:
        """True once the prompt's KV has landed; False when it is recomputed here (or failed)."""
        first_block = claim.num_cached_tokens // self._engine.engine.kv.tokens_per_block
        order = PrefillOrder(request, self._config.worker_id, first_block, claim.block_ids[first_block:],
                             self._config.transfer_timeout_s)
        start = time.perf_counter()
        try:
            try:
                result = await peer.prefill(order, self._config.transfer_timeout_s + 1.0)
            except UnknownPeerError as exc:
                log.info("prefill worker at %s does not know us (%s): handshaking again", peer.address, exc)
                await self._peers.forget(peer)
                peer = await self._peers.get(peer.address)
                result = await peer.prefill(order, self._config.transfer_timeout_s + 1.0)
        except PdserveError as exc:
            log.warning("KV transfer for %s from %s failed: %s", request.request_id, peer.address, exc)
            self._metrics.failures.labels("received").inc()
            if isinstance(exc, (WorkerUnavailableError, UnknownPeerError)):
                await self._peers.forget(peer)
            await self._engine.fail_remote(request.request_id, self._config.recompute_on_failure,
                                           f"KV transfer from {peer.address} failed: {exc}")
            return False
        self._metrics.transferred("received", result.num_blocks, result.num_bytes)
        self._metrics.remote_prefill_seconds.observe(time.perf_counter() - start)
        await self._engine.complete_remote(request.request_id, result.first_token, result.logprob)
        return True
