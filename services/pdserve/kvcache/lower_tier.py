"""`LowerTier`: the bookkeeping of a tier below the device — host memory (TensorRT-LLM's
secondary pool), and disk below it.

A block the device evicts moves to the host tier when its retention priority is at least
`secondary_offload_min_priority` (lower ones are dropped); one the host tier evicts moves on to
the disk tier by the same rule. Each keeps its block key, parent and priority. The tiers are
inclusive: a block copied back to the device (onboarded) stays where it was, so evicting it again
costs no copy. When full, a tier evicts its own entry of lowest priority, least recently used
first, skipping entries pinned by a claim in progress (a batch's promise holds until its copies
are recorded). The bytes live elsewhere (the engine's host tensor, one slot per entry; one file
per block on disk); `TierMove`s tell the engine what to copy, in order.
"""
import enum
import heapq
from dataclasses import dataclass

from pdserve.common.ids import BlockHash, BlockId


class MoveKind(enum.Enum):
    OFFLOAD = "offload"  # device block -> host slot
    ONBOARD = "onboard"  # host slot -> device block
    SPILL = "spill"  # host slot -> the disk file of `block_hash`
    LOAD = "load"  # the disk file of `block_hash` -> device block
    DELETE = "delete"  # the disk file of `block_hash` is no longer wanted


@dataclass(frozen=True, slots=True)
class TierMove:
    """One copy the engine must make before any forward or transfer touches its blocks. Moves are
    executed in the order they were recorded. `block_id` is -1 where no device block takes part,
    `slot` -1 where no host slot does."""

    kind: MoveKind
    block_id: BlockId
    slot: int
    block_hash: BlockHash | None = None
    priority: int = 0
    parent: BlockHash | None = None


@dataclass(slots=True)
class TierEntry:
    slot: int
    parent: BlockHash | None
    priority: int
    lora_id: int | None
    last_used: int
    pins: int = 0
    verified: bool = True  # a disk file found at start is checked at its first hit


class LowerTier:
    """Up to `num_slots` cached blocks by block key; `min_priority` gates what moves down."""

    def __init__(self, num_slots: int, min_priority: int) -> None:
        self.num_slots = num_slots
        self.min_priority = min_priority
        self.entries: dict[BlockHash, TierEntry] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self._heap: list[tuple[int, int, BlockHash]] = []  # (priority, last_used, hash), stale entries skipped
        self._tick = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: BlockHash) -> TierEntry | None:
        return self.entries.get(block_hash)

    def admits(self, priority: int) -> bool:
        return self.num_slots > 0 and priority >= self.min_priority

    def touch(self, block_hash: BlockHash) -> None:
        entry = self.entries[block_hash]
        self._tick += 1
        entry.last_used = self._tick
        heapq.heappush(self._heap, (entry.priority, entry.last_used, block_hash))
        if len(self._heap) > 2 * self.num_slots + 64:  # drop stale entries (amortised O(1))
            self._heap = [(e.priority, e.last_used, h) for h, e in self.entries.items()]
            heapq.heapify(self._heap)

    def take_slot(self) -> tuple[int, BlockHash | None, TierEntry | None] | None:
        """A slot for a new entry, and the key and entry evicted to free it (None if a slot was
        free). None when every entry is pinned."""
        if self.free_slots:
            return self.free_slots.pop(), None, None
        pinned = []
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                priority, last_used, block_hash = item
                entry = self.entries.get(block_hash)
                if entry is None or (entry.priority, entry.last_used) != (priority, last_used):
                    continue  # stale
                if entry.pins:
                    pinned.append(item)
                    continue
                del self.entries[block_hash]
                return entry.slot, block_hash, entry
            return None
        finally:
            for item in pinned:
                heapq.heappush(self._heap, item)

    def add(self, block_hash: BlockHash, slot: int, parent: BlockHash | None, priority: int,
            lora_id: int | None, verified: bool = True) -> None:
        self.entries[block_hash] = TierEntry(slot, parent, priority, lora_id, 0, verified=verified)
        self.touch(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        entry = self.entries.pop(block_hash)
        self.free_slots.append(entry.slot)

    def pin(self, block_hash: BlockHash) -> None:
        self.entries[block_hash].pins += 1

    def unpin(self, block_hash: BlockHash) -> None:
        self.entries[block_hash].pins -= 1

    def clear(self) -> list[BlockHash]:
        """Drop every entry; their keys."""
        dropped = list(self.entries)
        self.entries.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._heap = []
        return dropped

    def check(self) -> list[str]:
        """Broken invariants (empty when sound): each slot used once, used + free == all."""
        problems = []
        used = [e.slot for e in self.entries.values()]
        if len(used) != len(set(used)) or set(used) & set(self.free_slots):
            problems.append("lower tier: a slot is used twice")
        if len(used) + len(self.free_slots) != self.num_slots:
            problems.append(f"lower tier: {len(used)} used + {len(self.free_slots)} free != {self.num_slots}")
        if any(e.pins for e in self.entries.values()):
            problems.append("lower tier: an entry is still pinned between claims")
        return problems
