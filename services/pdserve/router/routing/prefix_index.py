"""The router's prefix index: which workers hold which block keys, in which tier.

A block key is a chained digest (it names its whole prefix, salt and LoRA included), so a
flat map from key to holders is a prefix tree in disguise: a request's overlap with a
worker is the number of its leading keys that worker holds, stopping at the first miss.

Per worker the index follows the worker's KV event stream. Contracts:
- a worker's part is *synced* only after `load_snapshot`; events are applied only to a synced
  worker and only in order: an event with seq below the next expected one is already in the
  snapshot and skipped; one above it is a gap, reported to the caller (who resyncs);
- `mark_unsynced` keeps the worker's entries as an estimate (a cache we lost track of is
  unknown, not empty) but refuses events until the next snapshot;
- `remove_worker` drops every entry of the worker.
"""
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.common.ids import BlockHash, WorkerId
from pdserve.kvcache import AllCleared, BlockRemoved, BlockStored, BlockUpdated, KvEvent, Tier


@dataclass(frozen=True, slots=True)
class Overlap:
    """A worker's leading run of a request's block keys, by the tier each block is in."""

    num_device: int = 0
    num_host: int = 0
    num_disk: int = 0
    is_synced: bool = True  # False: an estimate from a worker whose events were lost

    @property
    def num_blocks(self) -> int:
        return self.num_device + self.num_host + self.num_disk


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    GAP = "gap"  # an event was missing: take a snapshot
    UNSYNCED = "unsynced"  # the worker has no snapshot yet: take one


@dataclass(slots=True)
class _WorkerPart:
    blocks: dict[BlockHash, Tier] = field(default_factory=dict)
    next_seq: int | None = None  # None: not synced


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, dict[WorkerId, Tier]] = {}
        self._parts: dict[WorkerId, _WorkerPart] = {}

    # ---- queries -------------------------------------------------------------------------------

    def overlaps(self, block_hashes: Sequence[BlockHash], workers: Iterable[WorkerId]) -> dict[WorkerId, Overlap]:
        """Each of `workers`' overlap with the request whose keys are `block_hashes`, in order."""
        counts = {w: [0, 0, 0] for w in workers}
        matching = set(counts)
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            if not holders:
                break
            matching = {w for w in matching if w in holders}
            if not matching:
                break
            for worker in matching:
                counts[worker][holders[worker]] += 1
        return {w: Overlap(*c, is_synced=self.is_synced(w)) for w, c in counts.items()}

    def is_synced(self, worker: WorkerId) -> bool:
        part = self._parts.get(worker)
        return part is not None and part.next_seq is not None

    def num_blocks(self, worker: WorkerId) -> int:
        part = self._parts.get(worker)
        return 0 if part is None else len(part.blocks)

    def tier_of(self, worker: WorkerId, block_hash: BlockHash) -> Tier | None:
        return self._holders.get(block_hash, {}).get(worker)

    # ---- updates -------------------------------------------------------------------------------

    def load_snapshot(self, worker: WorkerId, blocks: Iterable[tuple[BlockHash, Tier]], next_seq: int) -> None:
        """Replace the worker's part with `blocks`; it reflects every event before `next_seq`."""
        self._drop_entries(worker)
        part = self._parts[worker] = _WorkerPart(next_seq=next_seq)
        for block_hash, tier in blocks:
            self._put(worker, part, block_hash, tier)

    def apply(self, worker: WorkerId, events: Iterable[KvEvent]) -> ApplyResult:
        """Apply events in order; stops at the first gap (events after it are not applied)."""
        part = self._parts.get(worker)
        if part is None or part.next_seq is None:
            return ApplyResult.UNSYNCED
        for event in events:
            if event.seq < part.next_seq:
                continue
            if event.seq > part.next_seq:
                return ApplyResult.GAP
            self._apply_one(worker, part, event)
            part.next_seq += 1
        return ApplyResult.APPLIED

    def mark_unsynced(self, worker: WorkerId) -> None:
        part = self._parts.setdefault(worker, _WorkerPart())
        part.next_seq = None

    def remove_worker(self, worker: WorkerId) -> None:
        self._drop_entries(worker)
        self._parts.pop(worker, None)

    # ---- internals -----------------------------------------------------------------------------

    def _apply_one(self, worker: WorkerId, part: _WorkerPart, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                self._put(worker, part, block_hash, event.tier)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                if part.blocks.get(block_hash) == event.tier:  # else it lives on in another tier
                    self._discard(worker, part, block_hash)
        elif isinstance(event, BlockUpdated):
            if event.block_hash in part.blocks:
                self._put(worker, part, event.block_hash, event.tier)
        elif isinstance(event, AllCleared):
            self._drop_entries(worker)

    def _put(self, worker: WorkerId, part: _WorkerPart, block_hash: BlockHash, tier: Tier) -> None:
        part.blocks[block_hash] = tier
        self._holders.setdefault(block_hash, {})[worker] = tier

    def _discard(self, worker: WorkerId, part: _WorkerPart, block_hash: BlockHash) -> None:
        del part.blocks[block_hash]
        holders = self._holders[block_hash]
        del holders[worker]
        if not holders:
            del self._holders[block_hash]

    def _drop_entries(self, worker: WorkerId) -> None:
        part = self._parts.get(worker)
        if part is None:
            return
        for block_hash in list(part.blocks):
            self._discard(worker, part, block_hash)
