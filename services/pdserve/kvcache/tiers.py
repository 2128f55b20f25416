"""`LowerTiers`: what the KV cache manager does with the host and disk tiers beside its device
pool — whether a prefix continues into them, onboarding hits, blocks found on disk at start,
the stop-time spill, blocks whose copy back failed — and the counters of it all.

The moves between tiers themselves are queued by the pool (`pool.moves`, eviction) and here
(onboarding, deletions); `drain_moves` hands them to the engine in order.
"""
from collections.abc import Callable, Sequence

from pdserve.common.ids import BlockHash, BlockId
from pdserve.kvcache.block import KvBlock, Tier
from pdserve.kvcache.events import EventBuffer
from pdserve.kvcache.lower_tier import LowerTier, MoveKind, TierEntry, TierMove
from pdserve.kvcache.pool import BlockPool
from pdserve.kvcache.request import CacheRequest


class LowerTiers:
    def __init__(self, pool: BlockPool, events: EventBuffer, tokens_per_block: int,
                 disk_verifier: Callable[[BlockHash], bool] | None = None) -> None:
        self.pool = pool
        self.events = events
        self.host: LowerTier | None = pool.host
        self.disk: LowerTier | None = pool.disk
        self.tokens_per_block = tokens_per_block
        self._verify = disk_verifier
        self.hit_tokens = [0] * len(Tier)  # where the prefix hits came from
        self.num_offloaded = self.num_onboarded = self.num_spilled = self.num_loaded = 0
        self.num_corrupt = 0  # disk blocks that failed their check or their read (used as misses)

    def holds(self, block_hash: BlockHash) -> bool:
        """In the host tier, or on disk and sound (a block found at start is checked at its first
        hit; a corrupt one is deleted, counted and a miss)."""
        if self.host is not None and block_hash in self.host:
            return True
        entry = self.disk.get(block_hash) if self.disk is not None else None
        if entry is None:
            return False
        if entry.verified or self._verify is None or self._verify(block_hash):
            entry.verified = True
            return True
        self._drop_from_disk(block_hash)
        return False

    def tier_of(self, block_hash: BlockHash) -> Tier:
        return Tier.HOST if self.host is not None and block_hash in self.host else Tier.DISK

    def entry(self, block_hash: BlockHash) -> TierEntry:
        for tier in (self.host, self.disk):
            if tier is not None and (found := tier.get(block_hash)) is not None:
                return found
        raise KeyError(block_hash)

    def onboard(self, request: CacheRequest, matched: list[KvBlock], lower: list[BlockHash]) -> list[KvBlock]:
        """Device blocks for the lower-tier part of a prefix, published now, their copies queued.
        A key another request of the batch onboarded already is shared instead."""
        blocks: list[KvBlock] = []
        for block_hash in lower:
            existing = self.pool.lookup(block_hash)
            if existing is not None:  # onboarded by an earlier request of the batch: a device hit now
                self.pool.ref(existing)
                blocks.append(existing)
                self.hit_tokens[Tier.DEVICE] += self.tokens_per_block
                continue
            (block,) = self.pool.allocate(1)
            tier = self.tier_of(block_hash)
            entry = self.entry(block_hash)  # pinned since phase 1
            parent = (matched + blocks)[-1] if matched or blocks else None
            self.pool.publish(block, block_hash, parent, entry.priority, None, request.lora_id, onboarded=tier)
            in_host = tier is Tier.HOST
            self.pool.moves.append(TierMove(MoveKind.ONBOARD if in_host else MoveKind.LOAD, block.block_id,
                                            entry.slot if in_host else -1, block_hash))
            (self.host if in_host else self.disk).touch(block_hash)  # type: ignore[union-attr]
            self.hit_tokens[tier] += self.tokens_per_block
            blocks.append(block)
        return blocks

    def blocks_by_tier(self) -> list[tuple[BlockHash, Tier]]:
        found = [(h, Tier.DEVICE) for h in self.pool.cached]
        if self.host is not None:
            found += [(h, Tier.HOST) for h in self.host.entries if h not in self.pool.cached]
        if self.disk is not None:
            found += [(h, Tier.DISK) for h in self.disk.entries
                      if h not in self.pool.cached and (self.host is None or h not in self.host)]
        return found

    def drain_moves(self) -> list[TierMove]:
        moves, self.pool.moves = self.pool.moves, []
        self.num_offloaded += sum(1 for m in moves if m.kind is MoveKind.OFFLOAD)
        self.num_onboarded += sum(1 for m in moves if m.kind is MoveKind.ONBOARD)
        self.num_spilled += sum(1 for m in moves if m.kind is MoveKind.SPILL)
        self.num_loaded += sum(1 for m in moves if m.kind is MoveKind.LOAD)
        return moves

    def discard_unreadable(self, block_id: BlockId) -> None:
        block = self.pool.blocks[block_id]
        block_hash = block.block_hash
        if block_hash is None:
            return
        self.pool.forget(block)
        if self.disk is not None and block_hash in self.disk and (self.host is None or block_hash not in self.host):
            self._drop_from_disk(block_hash)

    def adopt_disk_blocks(self, blocks: Sequence[tuple[BlockHash, BlockHash | None, int]]) -> int:
        if self.disk is None:
            return 0
        taken = 0
        for block_hash, parent, priority in blocks:
            if block_hash in self.disk or not self.disk.free_slots:
                continue
            self.disk.add(block_hash, self.disk.free_slots.pop(), parent, priority, None, verified=False)
            self.events.stored([block_hash], parent, Tier.DISK, priority, None)
            taken += 1
        return taken

    def spill_host(self) -> list[TierMove]:
        if self.host is None or self.disk is None:
            return []
        for block_hash, entry in sorted(self.host.entries.items(), key=lambda item: -item[1].last_used):
            if block_hash not in self.disk and self.disk.admits(entry.priority):
                self.pool.keep_on_disk(block_hash, entry)
        return self.drain_moves()

    def clear(self) -> None:
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.pool.moves += [TierMove(MoveKind.DELETE, BlockId(-1), -1, h) for h in self.disk.clear()]

    def problems(self) -> list[str]:
        return [p for tier in (self.host, self.disk) if tier is not None for p in tier.check()]

    def _drop_from_disk(self, block_hash: BlockHash) -> None:
        """A disk block that failed its check or its read: deleted, counted, announced if no tier holds it."""
        self.disk.remove(block_hash)  # type: ignore[union-attr]
        self.num_corrupt += 1
        self.pool.moves.append(TierMove(MoveKind.DELETE, BlockId(-1), -1, block_hash))
        if block_hash not in self.pool.cached and (self.host is None or block_hash not in self.host):
            self.events.removed([block_hash], Tier.DISK)
