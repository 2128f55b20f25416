"""Which cached-free block to evict next: lowest retention priority, LRU within a priority.

Only leaves are candidates (a block with cached children would leave them unreachable), so a
prefix is evicted from its tail inward. Entries are kept in a heap with lazy invalidation: a block's
`version` is bumped whenever its entry goes stale (revived, re-prioritised), and stale entries are
skipped when popped. Priorities with a duration fall back to the default when they expire; expiry is
applied before every eviction so an expired high priority never shields a block.
"""
import heapq
from collections.abc import Callable

from pdserve.common.request import DEFAULT_RETENTION_PRIORITY
from pdserve.kvcache.block import KvBlock


class EvictionQueue:
    """Min-heap of evictable leaves keyed by (priority, last_used); `use_priority=False` is plain LRU."""

    def __init__(self, use_priority: bool, on_expired: Callable[[KvBlock], None], capacity: int) -> None:
        self._use_priority = use_priority
        self._compact_above = 2 * capacity + 64
        self._heap: list[tuple[int, int, int, int, KvBlock]] = []
        self._expiries: list[tuple[float, int, int, KvBlock]] = []
        self._on_expired = on_expired

    def push(self, block: KvBlock) -> None:
        """Make `block` (an evictable leaf) a candidate; any older entry for it goes stale."""
        block.version += 1
        priority = block.priority if self._use_priority else 0
        heapq.heappush(self._heap, (priority, block.last_used, block.block_id, block.version, block))

    def invalidate(self, block: KvBlock) -> None:
        block.version += 1

    def watch_expiry(self, block: KvBlock) -> None:
        """Remember to reset `block`'s priority when its duration ends."""
        if block.priority_expires_at is not None:
            heapq.heappush(self._expiries, (block.priority_expires_at, block.block_id, block.version, block))

    def expire(self, now: float) -> None:
        """Reset every priority whose duration has passed to the default priority."""
        while self._expiries and self._expiries[0][0] <= now:
            expires_at, _, _, block = heapq.heappop(self._expiries)
            if block.priority_expires_at != expires_at or block.block_hash is None:
                continue
            block.priority = DEFAULT_RETENTION_PRIORITY
            block.priority_expires_at = None
            self._on_expired(block)
            if block.is_evictable:
                self.push(block)

    def pop(self) -> KvBlock | None:
        """The next block to evict, or None when no evictable block is left."""
        while self._heap:
            _, _, _, version, block = heapq.heappop(self._heap)
            if version == block.version and block.is_evictable:
                return block
        return None

    def compact(self) -> None:
        """Drop stale entries once the heap outgrows twice the block count (amortised O(1))."""
        if len(self._heap) <= self._compact_above:
            return
        live = [e for e in self._heap if e[3] == e[4].version and e[4].is_evictable]
        heapq.heapify(live)
        self._heap = live

    def queued_blocks(self) -> set[KvBlock]:
        """Every block whose current entry is in the heap, in one pass (for the integrity check)."""
        return {e[4] for e in self._heap if e[3] == e[4].version}
