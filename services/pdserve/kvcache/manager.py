"""`KvCacheManager`: one per worker; decides which physical blocks each sequence uses.

A sequence's blocks, by token position:

    # | matched from the prefix cache | computed by this worker | reserved, KV not yet written |

Blocks become reusable (published under their block key) only once full and computed: a block
published before its KV is written would poison the cache. A request's published blocks always
have their cached ancestors among its own blocks, so every cached-free block is evictable in turn.

With lower tiers (`num_host_blocks`, `num_disk_blocks` > 0), a prefix continues past the
device's blocks into the host tier's, then the disk tier's: those blocks are cached tokens too.
Phase 2 of the claim gives each a device block, published at once, and queues its copy back
(`drain_tier_moves`: the engine makes the copies, in order, before any forward or transfer
reads the blocks). A disk block found at start is checked (`disk_verifier`) at its first hit: a
corrupt one is a miss, deleted, and counted — never KV the claim promises.
"""
import math
import time
from collections.abc import Callable, Sequence

from pdserve.common.errors import (DuplicateRequestError, InvalidRequestError, OutOfBlocksError,
                                   UnknownRequestError)
from pdserve.common.ids import BlockHash, BlockId, RequestId
from pdserve.kvcache.block import KvBlock, Tier
from pdserve.kvcache.config import KvCacheConfig
from pdserve.kvcache.events import EventBuffer, KvEvent
from pdserve.kvcache.lower_tier import LowerTier, TierMove
from pdserve.kvcache.tiers import LowerTiers
from pdserve.kvcache.integrity import IntegrityError, check_pool_integrity
from pdserve.kvcache.pool import BlockPool
from pdserve.kvcache.publishing import publish_full_blocks
from pdserve.kvcache.claims import ClaimedSequence, ClaimResult, PrefixAnalysis
from pdserve.kvcache.request import CacheRequest
from pdserve.kvcache.windows import SkippedSlices, num_reusable

__all__ = ["ClaimResult", "IntegrityError", "KvCacheManager", "PrefixAnalysis"]


class KvCacheManager:
    """Paged KV bookkeeping: prefix matching, the two-phase claim, growth, publishing, eviction."""

    def __init__(self, config: KvCacheConfig, num_blocks: int, clock: Callable[[], float] = time.monotonic,
                 num_host_blocks: int = 0, num_disk_blocks: int = 0,
                 disk_verifier: Callable[[BlockHash], bool] | None = None) -> None:
        if num_blocks < 1:
            raise InvalidRequestError(f"num_blocks={num_blocks}: need at least one block", "num_blocks")
        if num_host_blocks < 0 or num_disk_blocks < 0:
            raise InvalidRequestError("lower tiers need >= 0 blocks", "num_host_blocks")
        if num_disk_blocks and not num_host_blocks:
            raise InvalidRequestError("a disk tier needs a host tier above it", "num_disk_blocks")
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.events = EventBuffer(config.event_buffer_max_size)
        threshold = config.secondary_offload_min_priority
        self.host = LowerTier(num_host_blocks, threshold) if num_host_blocks else None
        self.disk = LowerTier(num_disk_blocks, threshold) if num_disk_blocks else None
        self.pool = BlockPool(num_blocks, self.events, config.eviction_policy == "priority", clock, self.host, self.disk)
        self.tiers = LowerTiers(self.pool, self.events, config.tokens_per_block, disk_verifier)
        self._clock = clock
        self._seqs: dict[RequestId, ClaimedSequence] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free plus cached-free)."""
        return self.pool.num_available

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_available

    def has_request(self, request_id: RequestId) -> bool:
        return request_id in self._seqs

    def block_ids(self, request_id: RequestId) -> list[BlockId]:
        return [b.block_id for b in self._get(request_id).blocks]

    def num_computed_tokens(self, request_id: RequestId) -> int:
        return self._get(request_id).num_computed_tokens

    def cached_blocks_by_tier(self) -> list[tuple[BlockHash, Tier]]:
        """Every block key in the cache with the best tier holding it (a snapshot for a consumer
        that lost events)."""
        return self.tiers.blocks_by_tier()

    def drain_tier_moves(self) -> list[TierMove]:
        """The copies between tiers queued since the last call, in the order they must run."""
        return self.tiers.drain_moves()

    def discard_unreadable(self, block_id: BlockId) -> None:
        """A block whose copy back from a lower tier failed: no longer findable under its key (its
        holders must recompute it), and its disk file, if that was the source, counted as corrupt
        and deleted."""
        self.tiers.discard_unreadable(block_id)

    def holders_of(self, block_ids: set[BlockId]) -> list[RequestId]:
        """The sequences holding any of `block_ids`."""
        return [rid for rid, seq in self._seqs.items() if any(b.block_id in block_ids for b in seq.blocks)]

    def adopt_disk_blocks(self, blocks: Sequence[tuple[BlockHash, BlockHash | None, int]]) -> int:
        """Take over blocks found on disk at start, (key, parent key, priority) each, parents
        first: each is announced (`stored`, tier DISK) and checked at its first hit. Stops when the
        tier is full; how many were taken."""
        return self.tiers.adopt_disk_blocks(blocks)

    def spill_host_tier(self) -> list[TierMove]:
        """At a graceful stop: queue every host-tier block the disk tier admits and lacks for
        writing to disk (evicting older disk blocks as needed); the moves, to make now."""
        return self.tiers.spill_host()

    def drain_events(self) -> list[KvEvent]:
        return self.events.drain()

    def analyze_prefix_reuse(self, request: CacheRequest) -> PrefixAnalysis:
        """One walk over the request's block keys: what is cached, what must be allocated, whether it fits."""
        request.validate()
        matched, lower = self._match(request)
        num_revived = sum(1 for b in matched if b.ref_count == 0)
        available = self.pool.num_available - num_revived
        by_tier = [0] * len(Tier)
        for block in matched:
            by_tier[block.tier] += 1
        for block_hash in lower:
            by_tier[self.tiers.tier_of(block_hash)] += 1
        num_new = self._num_claim_blocks(request) - len(matched)
        num_cached = len(matched) + len(lower)
        return PrefixAnalysis(
            num_cached_blocks=num_cached,
            num_cached_tokens=num_cached * self.tokens_per_block,
            num_cached_by_tier=tuple(by_tier),
            num_onboard_blocks=len(lower),
            num_new_blocks=num_new,
            num_available_blocks=available,
            fits=num_new <= available,
        )

    # ---- the two-phase claim -------------------------------------------------------------------

    def add_sequence(self, request: CacheRequest) -> ClaimResult:
        return self.add_sequence_batch([request])[0]

    def add_sequence_batch(self, requests: Sequence[CacheRequest]) -> list[ClaimResult]:
        """Admit a whole batch, or none of it (OutOfBlocksError, nothing changed).

        Phase 1 matches and locks every reusable block of every request (device blocks by a
        reference, host-tier entries by a pin); phase 2 allocates the rest, onboarding host hits.
        Allocation for one request therefore never evicts a block another request of the batch matched.
        """
        self._check_new(requests)
        matches = [self._match(r) for r in requests]
        locked = [(b, b.last_used) for m, _ in matches for b in m]
        pinned = [h for _, lower in matches for h in lower]
        for block, _ in locked:
            self.pool.ref(block)
        for block_hash in pinned:
            self.tiers.entry(block_hash).pins += 1
        try:
            shared = len(pinned) - len(set(pinned))  # a host hit two requests share is onboarded once
            needed = sum(self._num_claim_blocks(r) - len(m) for r, (m, _) in zip(requests, matches)) - shared
            if needed > self.pool.num_available:
                available = self.pool.num_available
                for block, last_used in reversed(locked):
                    self.pool.unref(block, last_used)
                raise OutOfBlocksError(needed, available)
            return [self._admit(r, m, lower) for r, (m, lower) in zip(requests, matches)]
        finally:
            for block_hash in pinned:
                self.tiers.entry(block_hash).pins -= 1

    def _admit(self, request: CacheRequest, matched: list[KvBlock], lower: list[BlockHash]) -> ClaimResult:
        onboarded = self.tiers.onboard(request, matched, lower)
        matched = matched + onboarded
        new_blocks = self.pool.allocate(self._num_claim_blocks(request) - len(matched))
        for i, block in enumerate(matched):
            explicit = request.block_priority(i * self.tokens_per_block, (i + 1) * self.tokens_per_block)
            if explicit is not None:
                self.pool.set_priority(block, explicit[0], self._expiry(explicit[1]))
        num_cached = len(matched) * self.tokens_per_block
        if not isinstance(request.token_ids, list):
            request.token_ids = list(request.token_ids)  # `append_tokens` extends it
        seq = ClaimedSequence(request, matched + new_blocks, num_cached, len(matched), len(request.token_ids))
        self._seqs[request.request_id] = seq
        self.num_query_tokens += len(request.token_ids)
        self.num_hit_tokens += num_cached
        self.tiers.hit_tokens[Tier.DEVICE] += num_cached - len(onboarded) * self.tokens_per_block
        return ClaimResult(request.request_id, tuple(b.block_id for b in seq.blocks), num_cached)

    # ---- growth and publishing -----------------------------------------------------------------

    def allocate_slots(self, request_id: RequestId, num_new_tokens: int) -> list[BlockId]:
        """Make room for `num_new_tokens` past the computed ones; returns the blocks added.

        All or nothing: OutOfBlocksError leaves the sequence and the pool unchanged.
        """
        seq = self._get(request_id)
        if num_new_tokens < 0:
            raise InvalidRequestError(f"num_new_tokens={num_new_tokens}: must be >= 0", "num_new_tokens")
        needed = math.ceil((seq.num_computed_tokens + num_new_tokens) / self.tokens_per_block) - len(seq.blocks)
        if needed <= 0:
            return []
        blocks = self.pool.allocate(needed)
        seq.blocks.extend(blocks)
        return [b.block_id for b in blocks]

    def append_tokens(self, request_id: RequestId, token_ids: Sequence[int]) -> None:
        """Record generated tokens (their KV is written later, then `mark_computed`): they are
        appended to the request's own token list."""
        self._get(request_id).token_ids.extend(token_ids)

    def mark_computed(self, request_id: RequestId, num_tokens: int) -> None:
        """KV for the next `num_tokens` tokens is written; full blocks become reusable now."""
        seq = self._get(request_id)
        total = seq.num_computed_tokens + num_tokens
        limit = min(len(seq.token_ids), len(seq.blocks) * self.tokens_per_block)
        if num_tokens < 0 or total > limit:
            raise InvalidRequestError(
                f"mark_computed({request_id!r}, {num_tokens}): {seq.num_computed_tokens} computed, limit {limit}",
                "num_tokens",
            )
        seq.num_computed_tokens = total
        publish_full_blocks(self.pool, seq, self.tokens_per_block, self.config.enable_block_reuse, self._expiry)

    def lack_slices(self, request_id: RequestId, skipped: Sequence[SkippedSlices]) -> None:
        """Blocks of `request_id` whose KV arrived without some window layers' slices (`windows.py`),
        before `mark_computed` publishes them: marked, reused only out of reach, never moved down."""
        blocks = self._get(request_id).blocks
        if any(blocks[skip.block_index].block_hash is not None for skip in skipped):
            raise InvalidRequestError(f"a block of {request_id!r} lacking slices is published already", "skipped")
        for skip in skipped:
            blocks[skip.block_index].readable_from = skip.readable_from

    def free(self, request_id: RequestId) -> None:
        """Release the sequence's blocks, tail first (so a prefix's tail is evicted before its head)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise UnknownRequestError(f"free: unknown request {request_id!r}")
        for block in reversed(seq.blocks):
            self.pool.unref(block)

    def fork(self, request_id: RequestId, child: CacheRequest) -> tuple[ClaimResult, tuple[BlockId, BlockId] | None]:
        """A new sequence, `child`, sharing `request_id`'s computed full blocks (for `n` > 1
        completions); `child` holds the parent's computed tokens (its own list) and the same key
        dimensions, and may bring the parent's digests (`hash_chain`).

        A partially filled last block cannot be shared: the child gets a fresh block and the returned
        (source, destination) pair tells the engine which block's KV to copy.
        """
        parent = self._get(request_id)
        new_request_id = child.request_id
        if new_request_id in self._seqs:
            raise DuplicateRequestError(f"fork: request {new_request_id!r} already held")
        if list(child.token_ids) != parent.token_ids[:parent.num_computed_tokens]:
            raise InvalidRequestError(f"fork: {new_request_id!r} must hold the {parent.num_computed_tokens} "
                                      f"computed tokens of {request_id!r}", "token_ids")
        num_full, partial = divmod(parent.num_computed_tokens, self.tokens_per_block)
        copy_block = self.pool.allocate(1)[0] if partial else None
        shared = parent.blocks[:num_full]
        for block in shared:
            self.pool.ref(block)
        blocks = shared + ([copy_block] if copy_block else [])
        if not isinstance(child.token_ids, list):
            child.token_ids = list(child.token_ids)
        seq = ClaimedSequence(child, blocks, parent.num_computed_tokens, min(parent.num_published, num_full),
                        parent.num_claimed_tokens)
        self._seqs[new_request_id] = seq
        copy = (parent.blocks[num_full].block_id, copy_block.block_id) if copy_block else None
        return ClaimResult(new_request_id, tuple(b.block_id for b in blocks), 0), copy

    def reset_prefix_cache(self) -> bool:
        """Drop every cached-free block. Refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        self.pool.clear_cached_free()
        self.tiers.clear()
        self.events.cleared()
        return True

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + cached-free + in-use == total and ownership is consistent."""
        check_pool_integrity(self.pool, [s.blocks for s in self._seqs.values()])
        if problems := self.tiers.problems():
            raise IntegrityError("; ".join(problems))

    # ---- internals -----------------------------------------------------------------------------

    def _get(self, request_id: RequestId) -> ClaimedSequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        return seq

    def _check_new(self, requests: Sequence[CacheRequest]) -> None:
        seen: set[RequestId] = set()
        for request in requests:
            request.validate()
            if request.request_id in self._seqs or request.request_id in seen:
                raise DuplicateRequestError(f"request {request.request_id!r} is already held")
            seen.add(request.request_id)

    def _match(self, request: CacheRequest) -> tuple[list[KvBlock], list[BlockHash]]:
        """The longest reusable prefix: its device blocks, then the keys of the host-tier blocks
        that continue it (a device block's parent is always on the device, so the device part
        comes first). The last prompt token is always left to compute."""
        if not self.config.enable_block_reuse or not request.reuse_cached_prefix:
            return [], []
        max_blocks = (len(request.token_ids) - 1) // self.tokens_per_block
        matched: list[KvBlock] = []
        lower: list[BlockHash] = []
        for block_hash in request.block_hashes(self.tokens_per_block)[:max_blocks]:
            block = self.pool.lookup(block_hash) if not lower else None
            if block is not None:
                matched.append(block)
            elif self.tiers.holds(block_hash):
                lower.append(block_hash)
            else:
                break
        if self.pool.num_lacking_slices:  # a hit stops short of a query reading a missing slice
            num = num_reusable([b.readable_from for b in matched], len(lower), self.tokens_per_block)
            matched, lower = matched[:num], lower[:max(0, num - len(matched))]
        return matched, lower

    def _num_claim_blocks(self, request: CacheRequest) -> int:
        num_tokens = request.num_claim_tokens or len(request.token_ids)
        return math.ceil(num_tokens / self.tokens_per_block)

    def _expiry(self, duration_s: float | None) -> float | None:
        return None if duration_s is None else self._clock() + duration_s
