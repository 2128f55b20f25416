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
- `remove_worker` drops every entry of the worker;
- `hold` adds a dispatched request's keys to its worker's overlaps, after the run the worker's
  events gave, until `release` (the router calls it when the request no longer holds them): a
  burst of prompts sharing a prefix finds it where the first of them went, before that worker
  has stored it and said so (SGLang's router inserts a prompt at dispatch, Dynamo's
  approximate indexer predicts from its routing decisions).

Layout, for a decision at cluster size (see benchmarks/router_scale.py): worker number i (each
worker with a part has one) owns bit i of a mask and bits 24i..24i+23 of a packed counter.
- `_holders`: block -> mask of the workers holding it, in any tier;
- `_host`, `_disk`: block -> packed counter with 1 in the field of each worker keeping it in that
  tier (only blocks some worker keeps there have an entry).
A request's overlaps are then an AND of masks along its keys, one per group of consecutive blocks
with the same holders, stopping when no worker is left, and between the points where workers drop
out one sum of the packed counters: every worker's lower-tier blocks counted at once. Per block
the work runs in C (`groupby`, `sum` over `map`); Python steps per group and per worker with a
run. Equal overlaps are one shared object. Per worker a set of its keys makes dropping its part cost
its own blocks, not the index's.
"""
import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, reduce
from itertools import groupby, repeat
from operator import or_

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


_FIELD_BITS = 24  # a packed counter's field per worker: counts up to 2**24 blocks of one prompt
_FIELD_MASK = (1 << _FIELD_BITS) - 1


@dataclass(slots=True)
class _WorkerPart:
    number: int  # owns bit `number` of masks and field `number` of packed counters
    bit: int  # 1 << number
    unit: int  # 1 in its field of a packed counter
    keys: set[BlockHash] = field(default_factory=set)
    next_seq: int | None = None  # None: not synced


_NONE = Overlap()
_NONE_UNSYNCED = Overlap(is_synced=False)
_overlap = lru_cache(maxsize=4096)(Overlap)  # frozen, so shared; building one costs microseconds


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}  # block -> mask of the workers holding it
        self._host: dict[BlockHash, int] = {}  # block -> packed counter of the workers keeping it in the host tier
        self._disk: dict[BlockHash, int] = {}  # the same for the disk tier
        self._parts: dict[WorkerId, _WorkerPart] = {}
        self._worker_of_number: dict[int, WorkerId] = {}
        self._bit_of: dict[WorkerId, int] = {}
        self._synced: set[WorkerId] = set()
        self._held: dict[WorkerId, Counter[BlockHash]] = {}  # keys of requests in flight, by worker

    # ---- queries -------------------------------------------------------------------------------

    def overlaps(self, block_hashes: Sequence[BlockHash], workers: Iterable[WorkerId]) -> dict[WorkerId, Overlap]:
        """Each of `workers`' overlap with the request whose keys are `block_hashes`, in order."""
        result = dict.fromkeys(workers, _NONE)
        for worker in result.keys() - self._synced:
            result[worker] = _NONE_UNSYNCED
        wanted = reduce(or_, map(self._bit_of.get, result, repeat(0)), 0)
        for number, num_blocks, num_host, num_disk in self._runs(block_hashes, self._drops(block_hashes, wanted)):
            worker = self._worker_of_number[number]
            result[worker] = _overlap(num_blocks - num_host - num_disk, num_host, num_disk, worker in self._synced)
        for worker in self._held.keys() & result.keys():
            result[worker] = self._with_held(result[worker], block_hashes, self._held[worker])
        return result

    @staticmethod
    def _with_held(overlap: Overlap, block_hashes: Sequence[BlockHash], held: Counter[BlockHash]) -> Overlap:
        """`overlap` extended by the keys that follow its run and that requests in flight hold."""
        end = overlap.num_blocks
        while end < len(block_hashes) and block_hashes[end] in held:
            end += 1
        if end == overlap.num_blocks:
            return overlap
        return _overlap(overlap.num_device + end - overlap.num_blocks, overlap.num_host, overlap.num_disk,
                        overlap.is_synced)

    def is_synced(self, worker: WorkerId) -> bool:
        return worker in self._synced

    def num_blocks(self, worker: WorkerId) -> int:
        part = self._parts.get(worker)
        return 0 if part is None else len(part.keys)

    def tier_of(self, worker: WorkerId, block_hash: BlockHash) -> Tier | None:
        part = self._parts.get(worker)
        return None if part is None else self._tier_in(part, block_hash)

    # ---- updates -------------------------------------------------------------------------------

    def hold(self, worker: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """A request dispatched to `worker` will compute or receive `block_hashes` and hold them."""
        if block_hashes:
            self._held.setdefault(worker, Counter()).update(block_hashes)

    def release(self, worker: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """Undo one `hold` of the same keys (none left: nothing; the worker's events tell the rest)."""
        held = self._held.get(worker)
        if held is None:
            return
        for block_hash in block_hashes:
            if held[block_hash] <= 1:
                held.pop(block_hash, None)
            else:
                held[block_hash] -= 1
        if not held:
            del self._held[worker]

    def load_snapshot(self, worker: WorkerId, blocks: Iterable[tuple[BlockHash, Tier]], next_seq: int) -> None:
        """Replace the worker's part with `blocks`; it reflects every event before `next_seq`."""
        part = self._part(worker)
        self._drop_entries(part)
        part.next_seq = next_seq
        self._synced.add(worker)
        for block_hash, tier in blocks:
            self._put(part, block_hash, tier)

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
            self._apply_one(part, event)
            part.next_seq += 1
        return ApplyResult.APPLIED

    def mark_unsynced(self, worker: WorkerId) -> None:
        self._part(worker).next_seq = None
        self._synced.discard(worker)

    def remove_worker(self, worker: WorkerId) -> None:
        self._held.pop(worker, None)
        part = self._parts.pop(worker, None)
        if part is None:
            return
        self._drop_entries(part)
        del self._worker_of_number[part.number]
        del self._bit_of[worker]
        self._synced.discard(worker)

    # ---- internals -----------------------------------------------------------------------------

    def _drops(self, block_hashes: Sequence[BlockHash], wanted: int) -> list[tuple[int, int]]:
        """(position, mask) in order of position: the `wanted` workers whose leading run of held
        blocks ends at `position` (the first block each lacks; the prompt's length if none).

        Consecutive blocks with the same holders (a chain the same workers stored) are one group
        of `groupby`, compared in C: Python steps once per group, not per block."""
        drops, matching, position = [], wanted, 0
        if not matching:
            return drops
        for holders, group in groupby(map(self._holders.get, block_hashes, repeat(0))):
            held = matching & holders
            if held != matching:
                drops.append((position, matching & ~held))
                matching = held
                if not matching:
                    return drops
            position += len(list(group))
        if matching:
            drops.append((position, matching))
        return drops

    def _runs(self, block_hashes: Sequence[BlockHash],
              drops: list[tuple[int, int]]) -> Iterable[tuple[int, int, int, int]]:
        """(worker number, leading blocks held, of them in the host tier, on disk) for every worker
        with a run; the packed tier counters of each stretch between drops summed once."""
        host = disk = start = 0
        for end, dropped in drops:
            if end == 0:
                continue
            segment = block_hashes[start:end]
            host += sum(filter(None, map(self._host.get, segment))) if self._host else 0
            disk += sum(filter(None, map(self._disk.get, segment))) if self._disk else 0
            start = end
            while dropped:
                number = (dropped & -dropped).bit_length() - 1
                shift = _FIELD_BITS * number
                yield number, end, (host >> shift) & _FIELD_MASK, (disk >> shift) & _FIELD_MASK
                dropped &= dropped - 1

    def _part(self, worker: WorkerId) -> _WorkerPart:
        part = self._parts.get(worker)
        if part is None:
            number = 0
            while number in self._worker_of_number:
                number += 1
            part = self._parts[worker] = _WorkerPart(number, 1 << number, 1 << (_FIELD_BITS * number))
            self._worker_of_number[number] = worker
            self._bit_of[worker] = part.bit
        return part

    def _tier_in(self, part: _WorkerPart, block_hash: BlockHash) -> Tier | None:
        if not self._holders.get(block_hash, 0) & part.bit:
            return None
        shift = _FIELD_BITS * part.number
        if (self._host.get(block_hash, 0) >> shift) & 1:
            return Tier.HOST
        return Tier.DISK if (self._disk.get(block_hash, 0) >> shift) & 1 else Tier.DEVICE

    def _apply_one(self, part: _WorkerPart, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                self._put(part, block_hash, event.tier)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                if self._tier_in(part, block_hash) == event.tier:  # else it lives on in another tier
                    self._discard(part, block_hash)
        elif isinstance(event, BlockUpdated):
            if self._holders.get(event.block_hash, 0) & part.bit:
                self._put(part, event.block_hash, event.tier)
        elif isinstance(event, AllCleared):
            self._drop_entries(part)

    def _put(self, part: _WorkerPart, block_hash: BlockHash, tier: Tier) -> None:
        part.keys.add(block_hash)
        self._holders[block_hash] = self._holders.get(block_hash, 0) | part.bit
        if tier is Tier.DEVICE and block_hash not in self._host and block_hash not in self._disk:
            return  # the common case: nothing to mark
        self._mark(self._host, part, block_hash, tier is Tier.HOST)
        self._mark(self._disk, part, block_hash, tier is Tier.DISK)

    def _discard(self, part: _WorkerPart, block_hash: BlockHash) -> None:
        part.keys.discard(block_hash)
        held = self._holders[block_hash] & ~part.bit
        if held:
            self._holders[block_hash] = held
        else:
            del self._holders[block_hash]
        self._mark(self._host, part, block_hash, False)
        self._mark(self._disk, part, block_hash, False)

    @staticmethod
    def _mark(tier_table: dict[BlockHash, int], part: _WorkerPart, block_hash: BlockHash, is_in: bool) -> None:
        """Set or clear the worker's field of the block's packed counter in `tier_table`."""
        packed = tier_table.get(block_hash, 0)
        if ((packed >> (_FIELD_BITS * part.number)) & 1) == is_in:
            return
        packed += part.unit if is_in else -part.unit
        if packed:
            tier_table[block_hash] = packed
        else:
            del tier_table[block_hash]

    def _drop_entries(self, part: _WorkerPart) -> None:
        for block_hash in list(part.keys):
            self._discard(part, block_hash)
