"""`HostTier`: the bookkeeping of the second tier, blocks kept in host memory after the device
let them go (TensorRT-LLM's secondary pool).

A block the device evicts moves here when its retention priority is at least
`secondary_offload_min_priority` (lower ones are dropped); it keeps its block key, parent and
priority. The tier is inclusive: a block copied back to the device (onboarded) stays here too,
so evicting it from the device again costs no copy. When full, the tier evicts its own entry of
lowest priority, least recently used first, skipping entries pinned by a claim in progress (a
batch's promise holds until its copies are recorded). The bytes live elsewhere (the engine's
host tensor, one slot per entry); `TierMove`s tell the engine what to copy, in order.
"""
import enum
import heapq
from dataclasses import dataclass

from pdserve.common.ids import BlockHash, BlockId


class MoveKind(enum.Enum):
    OFFLOAD = "offload"  # device block -> host slot
    ONBOARD = "onboard"  # host slot -> device block


@dataclass(frozen=True, slots=True)
class TierMove:
    """One block copy the engine must make before any forward or transfer touches `block_id`.
    Moves are executed in the order they were recorded."""

    kind: MoveKind
    block_id: BlockId
    slot: int


@dataclass(slots=True)
class HostEntry:
    slot: int
    parent: BlockHash | None
    priority: int
    lora_id: int | None
    last_used: int
    pins: int = 0


class HostTier:
    """Up to `num_slots` cached blocks by block key; `min_priority` gates what moves down."""

    def __init__(self, num_slots: int, min_priority: int) -> None:
        self.num_slots = num_slots
        self.min_priority = min_priority
        self.entries: dict[BlockHash, HostEntry] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self._heap: list[tuple[int, int, BlockHash]] = []  # (priority, last_used, hash), stale entries skipped
        self._tick = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: BlockHash) -> HostEntry | None:
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

    def take_slot(self) -> tuple[int, BlockHash | None] | None:
        """A slot for a new entry, and the key of the entry evicted to free it (None if a slot
        was free). None when every entry is pinned."""
        if self.free_slots:
            return self.free_slots.pop(), None
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
                return entry.slot, block_hash
            return None
        finally:
            for item in pinned:
                heapq.heappush(self._heap, item)

    def add(self, block_hash: BlockHash, slot: int, parent: BlockHash | None, priority: int,
            lora_id: int | None) -> None:
        self.entries[block_hash] = HostEntry(slot, parent, priority, lora_id, 0)
        self.touch(block_hash)

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
            problems.append("host tier: a slot is used twice")
        if len(used) + len(self.free_slots) != self.num_slots:
            problems.append(f"host tier: {len(used)} used + {len(self.free_slots)} free != {self.num_slots}")
        if any(e.pins for e in self.entries.values()):
            problems.append("host tier: an entry is still pinned between claims")
        return problems
