"""`Handoffs`: the sequences whose blocks wait on a KV transfer between workers, with leases.

    decode side:   reserve ─ REMOTE_PREFILL ─┬─ complete: the KV landed → the scheduler resumes it
                                             └─ fail: quarantined until the lease ends;
                                                the sequence recomputes under a fresh KV id
    prefill side:  hold ─ HELD ─── release: no write reads them any more → freed (stay cached)
                               └── the lease ends → freed

The one rule: a block that a remote write may still reach is never freed or published before
the write is known complete or its lease has run out. This component owns the sequences in
hand-off, the quarantine and the lease clock; it frees through the KV cache manager. The engine's
`RemotePrefill` decides what a completed or failed sequence does next.
"""
import itertools
from collections.abc import Callable

from pdserve.common.errors import TransferError
from pdserve.common.ids import BlockId, RequestId
from pdserve.engine.core.sequence import Sequence, SeqStatus
from pdserve.kvcache import KvCacheManager


class Handoffs:
    """Sequences in REMOTE_PREFILL or HELD, by request id, and the quarantined KV sequences."""

    def __init__(self, kv: KvCacheManager, clock: Callable[[], float]) -> None:
        self._kv = kv
        self._clock = clock
        self._seqs: dict[RequestId, Sequence] = {}
        self._quarantine: dict[RequestId, float] = {}  # KV sequence id -> when a late write can no longer land
        self._retries = itertools.count(1)
        self.num_lease_expiries = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, request_id: RequestId) -> Sequence | None:
        return self._seqs.get(request_id)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    @property
    def num_awaiting_kv(self) -> int:
        """Decode side: sequences whose prompt's KV has not landed yet."""
        return sum(seq.status is SeqStatus.REMOTE_PREFILL for seq in self._seqs.values())

    def reserve(self, seq: Sequence, lease_s: float) -> None:
        """Decode side: `seq`'s blocks are claimed; the rest of its prompt's KV comes from a peer."""
        seq.status = SeqStatus.REMOTE_PREFILL
        seq.lease_deadline = self._clock() + lease_s
        self._seqs[seq.request.request_id] = seq

    def hold(self, seq: Sequence) -> None:
        """Prefill side: `seq`'s prompt is computed; keep its blocks for the peer to receive."""
        seq.status = SeqStatus.HELD
        seq.lease_deadline = self._clock() + seq.hold_lease_s
        self._seqs[seq.request.request_id] = seq

    def held_block_ids(self, request_id: RequestId) -> list[BlockId]:
        """Prefill side: the held blocks; TransferError once they are not held (the lease ran out)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SeqStatus.HELD:
            raise TransferError(f"the KV of {request_id!r} is no longer held: its lease ended before the write")
        return self._kv.block_ids(seq.seq_id)

    def complete(self, request_id: RequestId) -> Sequence:
        """Decode side: every byte has landed; the prompt's blocks count as computed. An aborted
        sequence is freed here (its blocks are valid and stay cached)."""
        seq = self._seqs.pop(request_id)
        self._kv.mark_computed(seq.seq_id, seq.num_prompt_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.lease_deadline = None
        if seq.aborted:
            self._kv.free(seq.seq_id)
        return seq

    def fail(self, request_id: RequestId) -> Sequence:
        """Decode side: the transfer failed, but a write may still land (a cancelled transfer is
        no proof that no byte arrives). Its blocks are quarantined until the lease ends, never
        published; the sequence gets a fresh KV id so that it can recompute into other blocks."""
        seq = self._seqs.pop(request_id)
        self._quarantine[seq.seq_id] = seq.lease_deadline
        seq.seq_id = RequestId(f"{request_id}~{next(self._retries)}")
        seq.lease_deadline = None
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        return seq

    def release(self, request_id: RequestId) -> None:
        """Prefill side: no write reads the held blocks any more; free them (they stay cached)."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.status is SeqStatus.HELD:
            del self._seqs[request_id]
            self._kv.free(seq.seq_id)
            seq.status = SeqStatus.FINISHED

    def expire(self) -> list[Sequence]:
        """Release the HELD sequences past their lease; return the REMOTE_PREFILL ones past
        theirs, for the engine to fail (their quarantine, the lease being over, is freed by the
        next `free_quarantine`)."""
        now = self._clock()
        expired = []
        for request_id, seq in list(self._seqs.items()):
            if seq.lease_deadline is not None and seq.lease_deadline <= now:
                self.num_lease_expiries += 1
                if seq.status is SeqStatus.HELD:
                    self.release(request_id)
                else:
                    expired.append(seq)
        return expired

    def free_quarantine(self) -> None:
        now = self._clock()
        for seq_id, deadline in list(self._quarantine.items()):
            if deadline <= now:
                del self._quarantine[seq_id]
                self._kv.free(seq_id)
