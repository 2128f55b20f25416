"""`RemotePrefill`: an engine's side of a prompt computed on one worker and decoded on another.

    decode side:   admit (or reserve) ───────────────────┬─ complete: the peer's first token is emitted
                                                        └─ fail: recompute here, or end with an error
    prefill side:  a prefill_only request ends HELD → held_block_ids → release_held
    both:          reap_expired, every loop iteration: leases past their end, orders past start-by

`Handoffs` keeps the sequences in hand-off, their leases and the quarantine; this decides what a
completed, failed or expired hand-off does to the engine's requests. It is a part of its engine
and acts through it: the request table, the admission checks, new sequences, the copies between
tiers and token emission are the engine's.
"""
from collections.abc import Sequence
from dataclasses import replace

from pdserve.common.errors import OutOfBlocksError, TransferError
from pdserve.common.ids import BlockId, RequestId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.engine.core.sequence import SeqStatus
from pdserve.engine.model.sampler import SamplingRow
from pdserve.kvcache import ClaimResult
from pdserve.kvcache.windows import SkippedSlices


class RemotePrefill:
    """The hand-off commands of one `LLMEngine` (its `remote`); not thread-safe, as the engine."""

    def __init__(self, engine) -> None:  # an LLMEngine (not imported: it imports this module)
        self._engine = engine

    def admit(self, request: GenerationRequest, min_remote_tokens: int | None, lease_s: float,
              arrival_s: float | None = None) -> tuple[ClaimResult | None, str | None]:
        """Decode side, one sequence for the request: blocks reserved for a remote prefill (the
        claim, as `reserve`) when `min_remote_tokens` is set, at least that many prompt tokens
        are not cached here and blocks are free; else the request is queued for a local
        prefill, with the reason. A typed error refuses it, changing nothing."""
        engine = self._engine
        engine._validate(request)
        seq = engine._new_sequence(request, 0, list(request.prompt_token_ids), arrival_s)
        reason = "no_prefill_worker"
        if min_remote_tokens is not None:
            reuse = engine.kv.analyze_prefix_reuse(seq.cache_request())
            reason = "few_missing_tokens"
            if seq.num_prompt_tokens - reuse.num_cached_tokens >= min_remote_tokens:
                try:
                    return self._reserve(seq, lease_s), None
                except OutOfBlocksError:
                    reason = "no_free_blocks"
                except TransferError:  # a block of its cached prefix could not be read back
                    reason = "lower_tier_read_failed"
        engine._enqueue(seq)
        return None, reason

    def reserve(self, request: GenerationRequest, lease_s: float, arrival_s: float | None = None) -> ClaimResult:
        """Decode side: claim blocks for the whole prompt (its cached prefix reused locally).

        The prompt's remaining KV is expected from a peer before `lease_s` passes; then call
        `complete` or `fail`. OutOfBlocksError leaves nothing reserved.
        """
        self._engine._validate(request)
        return self._reserve(self._engine._new_sequence(request, 0, list(request.prompt_token_ids), arrival_s),
                             lease_s)

    def _reserve(self, seq, lease_s: float) -> ClaimResult:
        engine, request = self._engine, seq.request
        seq.times.scheduled_s, seq.times.prefilled_here = engine._clock(), False
        claim = engine.kv.add_sequence(seq.cache_request())
        if engine._move_between_tiers() & set(claim.block_ids):  # before a peer writes into the blocks
            engine.kv.free(seq.seq_id)
            raise TransferError(f"a cached block of {request.request_id!r} could not be read back from a lower tier")
        seq.num_computed_tokens = seq.num_cached_tokens = claim.num_cached_tokens
        engine.handoffs.reserve(seq, lease_s)
        engine._requests[request.request_id] = [seq]
        return claim

    def complete(self, request_id: RequestId, first_token: int, logprob=None,
                 skipped: Sequence[SkippedSlices] = ()) -> list[RequestOutput]:
        """Decode side: the prompt's KV has landed, but for the window layers' slices `skipped`
        (`kvcache/windows.py`), which are zeroed here and marked for the cache before its blocks
        are published; the first token (sampled by the peer) is emitted. Nothing happens once the
        lease has ended (the request ended then)."""
        engine = self._engine
        held = engine.handoffs.get(request_id)
        if held is None:
            return []
        if skipped:
            block_ids = engine.kv.block_ids(held.seq_id)
            engine.runner.kv.zero_layers([(block_ids[s.block_index], s.layers) for s in skipped])
            engine.kv.lack_slices(held.seq_id, skipped)
        seq = engine.handoffs.complete(request_id)
        if seq.aborted:
            return []
        engine.scheduler.resume(seq)
        engine.sampler.skip(SamplingRow(seq.request.sampling, seq.generator), engine.vocab_size)  # the peer's draw
        return [engine._advance(seq, first_token, logprob, engine._clock())]

    def fail(self, request_id: RequestId, recompute: bool, reason: str) -> list[RequestOutput]:
        """Decode side: the transfer failed, but a write may still land in the reserved blocks (a
        cancelled transfer is no proof that no byte arrives). They are quarantined until the lease
        ends, never published; the request recomputes into fresh blocks or ends with an error.
        Nothing happens once the lease has ended (the request ended then)."""
        engine = self._engine
        if engine.handoffs.get(request_id) is None:
            return []
        seq = engine.handoffs.fail(request_id)
        if seq.aborted:
            return []
        if recompute:
            seq.times.scheduled_s, seq.times.prefilled_here = None, True
            seq.status = SeqStatus.WAITING
            engine.scheduler.add(seq)
            return []
        engine._requests.pop(request_id, None)
        seq.status = SeqStatus.FINISHED
        return [replace(engine._output(seq, (), "", "error"), error=reason)]

    def held_block_ids(self, request_id: RequestId) -> list[BlockId]:
        """Prefill side: the blocks holding a finished prefill's KV, in prompt order."""
        return self._engine.handoffs.held_block_ids(request_id)

    def release_held(self, request_id: RequestId) -> None:
        """Prefill side: the peer has the KV (or gave up); free the blocks (they stay cached)."""
        self._engine.handoffs.release(request_id)

    def reap_expired(self) -> list[RequestOutput]:
        """Free blocks held for a peer, or quarantined, past their lease, and end the requests
        still queued past their start-by time (runs every loop iteration, idle or not)."""
        outputs = []
        for seq in self._engine.handoffs.expire():
            outputs += self.fail(seq.request.request_id, recompute=False, reason="KV transfer lease expired")
        self._engine.handoffs.free_quarantine()
        return outputs + self._end_unstarted()

    def _end_unstarted(self) -> list[RequestOutput]:
        engine = self._engine
        now = engine._clock()
        late = [seq for seq in engine.scheduler.waiting
                if seq.start_by is not None and seq.start_by <= now and seq.times.scheduled_s is None]
        outputs = []
        for seq in late:
            engine._requests.pop(seq.request.request_id, None)
            engine.scheduler.remove(seq)
            waited = now - seq.times.arrival_s
            outputs.append(replace(engine._output(seq, (), "", "error"),
                                   error=f"not started within its queue bound (waited {waited:.1f} s)"))
        return outputs
