"""KV cache events, numbered so a consumer (the router's prefix index) can detect gaps.

Each event carries a sequence number that increases by one per event. The buffer is bounded: when a
consumer falls behind, the oldest events are dropped and the gap in sequence numbers tells the
consumer to resynchronise from a snapshot.
"""
from collections import deque
from dataclasses import dataclass

from pdserve.common.ids import BlockHash
from pdserve.kvcache.block import Tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    seq: int
    block_hashes: tuple[BlockHash, ...]  # a chain: each block's parent is the previous one
    parent_hash: BlockHash | None  # parent of the first block
    tier: Tier
    priority: int
    lora_id: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    seq: int
    block_hashes: tuple[BlockHash, ...]
    tier: Tier


@dataclass(frozen=True, slots=True)
class BlockUpdated:
    """A cached block moved tier (from `old_tier` to `tier`) and/or changed retention priority."""

    seq: int
    block_hash: BlockHash
    tier: Tier
    priority: int
    old_tier: Tier | None = None  # None: the tier did not change


@dataclass(frozen=True, slots=True)
class AllCleared:
    seq: int


KvEvent = BlockStored | BlockRemoved | BlockUpdated | AllCleared


class EventBuffer:
    """A bounded FIFO of events with monotonically increasing sequence numbers."""

    def __init__(self, max_size: int) -> None:
        self._events: deque[KvEvent] = deque(maxlen=max_size) if max_size > 0 else deque(maxlen=0)
        self._next_seq = 0
        self.num_dropped = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def stored(self, hashes: list[BlockHash], parent: BlockHash | None, tier: Tier, priority: int, lora_id: int | None) -> None:
        self._push(BlockStored(self._take_seq(), tuple(hashes), parent, tier, priority, lora_id))

    def removed(self, hashes: list[BlockHash], tier: Tier) -> None:
        self._push(BlockRemoved(self._take_seq(), tuple(hashes), tier))

    def updated(self, block_hash: BlockHash, tier: Tier, priority: int, old_tier: Tier | None = None) -> None:
        self._push(BlockUpdated(self._take_seq(), block_hash, tier, priority, old_tier))

    def cleared(self) -> None:
        self._push(AllCleared(self._take_seq()))

    def drain(self) -> list[KvEvent]:
        """Every buffered event, oldest first; the buffer is left empty."""
        events = list(self._events)
        self._events.clear()
        return events

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _push(self, event: KvEvent) -> None:
        if self._events.maxlen == 0:
            return
        if len(self._events) == self._events.maxlen:
            self.num_dropped += 1
        self._events.append(event)
