"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes and unfinished prefill chunks), in arrival order,
each taking what the budget allows; when blocks run out the latest arrival is preempted (its
blocks freed, recomputed later from the prefix cache), so no request is dropped for lack of
memory. Then waiting sequences are admitted while the budget, `max_num_seqs` and the blocks
allow, all through one two-phase claim (`add_sequence_batch`). A prefix hit in a lower tier is not free:
its copy back costs a share of the token budget (`copy_cost_tokens`). A prompt whose next
uncached block is one this step computes for another prompt (a burst sharing a prefix not yet
cached) waits for the next step and finds it cached there, rather than computing it again
(SGLang's in-batch prefix check); admission stops at it, so arrival order holds.
"""
from bisect import insort
from collections import deque
from dataclasses import dataclass

from pdserve.common.errors import OutOfBlocksError
from pdserve.common.ids import BlockHash
from pdserve.engine.core.sequence import Sequence, SeqStatus
from pdserve.kvcache import KvCacheManager, Tier

# Tokens of the step budget one cached token costs when its block is copied back from a lower
# tier instead of computed: on CPU a ~1000-token prompt took 0.16 of its recompute time from the
# host tier and 0.20 from disk, its last token's forward included (benchmarks/tiers.py); a cold
# disk is slower than the page cache measured there.
COPY_COST_DIVISOR = {Tier.HOST: 8, Tier.DISK: 4}


def copy_cost_tokens(num_cached_by_tier: tuple[int, ...], tokens_per_block: int) -> int:
    """Budget tokens the copy back of a prefix's lower-tier blocks costs."""
    return sum(num_cached_by_tier[tier] * tokens_per_block // divisor for tier, divisor in COPY_COST_DIVISOR.items())


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_computed_tokens on
    drafts: tuple[int, ...] = ()  # speculative tokens verified after them (their slots reserved too)


class Scheduler:
    """Decides what runs each step; the KV cache manager decides which memory it uses."""

    def __init__(self, config: SchedulerConfig, kv: KvCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_prefill_tokens_queued(self) -> int:
        return sum(s.num_uncomputed for s in self.waiting) + sum(s.num_uncomputed for s in self.running if s.is_prefilling)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def resume(self, seq: Sequence) -> None:
        """Run a sequence whose prompt's KV is already in its blocks (received from a peer)."""
        seq.status = SeqStatus.RUNNING
        insort(self.running, seq, key=lambda s: s.arrival)

    def detach(self, seq: Sequence) -> None:
        """Stop running `seq` but keep its blocks (they are held for a peer)."""
        self.running.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):  # arrival order; later arrivals are preempted first
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for an earlier arrival
            n = min(seq.num_uncomputed, budget)
            if n > 0 and self._make_room(seq, n):
                drafts = seq.draft_tokens[:budget - n] if n == seq.num_uncomputed else ()
                drafts = drafts if drafts and self._has_room(seq, n + len(drafts)) else ()
                chunks.append(ScheduledChunk(seq, n, drafts))
                budget -= n + len(drafts)
        return chunks + self._admit(budget, chunks)

    def _has_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve blocks for `num_tokens` if free ones are left; drafts never preempt anyone."""
        try:
            self.kv.allocate_slots(seq.seq_id, num_tokens)
            return True
        except OutOfBlocksError:
            return False

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve blocks for `seq`'s next chunk, preempting the latest arrivals as needed.

        Victims are always at the tail of `running`, i.e. not yet scheduled this step.
        """
        while True:
            try:
                self.kv.allocate_slots(seq.seq_id, num_tokens)
                return True
            except OutOfBlocksError:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it waits first in line and recomputes (reusing the
        prefix cache)."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(self, budget: int, running: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Admit waiting sequences in order while they fit, all in one two-phase claim."""
        tpb = self.kv.tokens_per_block
        batch: list[tuple[Sequence, int]] = []
        requests = []
        blocks_left = self.kv.num_free_blocks
        computing: set[BlockHash] | None = None  # the full prompt blocks this step computes
        while self.waiting and budget > 0 and len(self.running) + len(batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cache_request = seq.cache_request()
            analysis = self.kv.analyze_prefix_reuse(cache_request)
            cached = analysis.num_cached_tokens
            if self.kv.config.enable_block_reuse and cache_request.reuse_cached_prefix:
                computing = computing if computing is not None else _blocks_computed(running, tpb)
                hashes = cache_request.block_hashes(tpb)
                first = analysis.num_cached_blocks
                if first < (len(seq.token_ids) - 1) // tpb and hashes[first] in computing:
                    break  # the next step finds that block cached
            copy_cost = copy_cost_tokens(analysis.num_cached_by_tier, tpb)
            if batch and copy_cost >= budget:
                break  # its copies would take the rest of this step; the next step starts with it
            n = min(len(seq.token_ids) - cached, max(budget - copy_cost, 1))
            revived = self.kv.num_free_blocks - analysis.num_available_blocks
            need = -(-(cached + n) // tpb) - analysis.num_cached_blocks + analysis.num_onboard_blocks + revived
            if need > blocks_left:
                break
            self.waiting.popleft()
            blocks_left -= need
            budget = max(budget - n - copy_cost, 0)
            batch.append((seq, n))
            requests.append(seq.cache_request(num_claim_tokens=cached + n))
            if computing is not None:
                computing.update(cache_request.block_hashes(tpb)[analysis.num_cached_blocks:(cached + n) // tpb])
        if not batch:
            return []
        claims = self.kv.add_sequence_batch(requests)
        scheduled = []
        for (seq, n), claim in zip(batch, claims):
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = seq.num_cached_tokens = claim.num_cached_tokens
            insort(self.running, seq, key=lambda s: s.arrival)
            scheduled.append(ScheduledChunk(seq, min(n, seq.num_uncomputed)))
        return scheduled


def _blocks_computed(chunks: list[ScheduledChunk], tokens_per_block: int) -> set[BlockHash]:
    """The full prompt blocks that running sequences' prefill chunks compute this step."""
    blocks: set[BlockHash] = set()
    for chunk in chunks:
        seq = chunk.seq
        begin = seq.num_computed_tokens // tokens_per_block
        end = (seq.num_computed_tokens + chunk.num_tokens) // tokens_per_block
        if seq.is_prefilling and end > begin:
            blocks.update(seq.cache_request().block_hashes(tokens_per_block)[begin:end])
    return blocks
