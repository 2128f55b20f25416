"""`BlockPool`: the physical blocks, the free list, the prefix-cache map and eviction.

The pool owns block state transitions; the manager decides which blocks a sequence gets.
With a host tier, a block evicted to make room moves down to it when its priority allows
(`lower_tier.py`), and one the host tier evicts moves on to the disk tier by the same rule: its
key stays findable there, and the copy is queued in `moves`.
"""
import time
from collections import deque
from collections.abc import Callable

from pdserve.common.errors import OutOfBlocksError
from pdserve.common.ids import BlockHash, BlockId
from pdserve.kvcache.block import KvBlock, Tier
from pdserve.kvcache.events import EventBuffer
from pdserve.kvcache.eviction import EvictionQueue
from pdserve.kvcache.lower_tier import LowerTier, MoveKind, TierEntry, TierMove


class BlockPool:
    """Blocks move free → in use → (published) cached-free → evicted → in use, never two places at once."""

    def __init__(self, num_blocks: int, events: EventBuffer, use_priority: bool, clock: Callable[[], float] = time.monotonic,
                 host: LowerTier | None = None, disk: LowerTier | None = None) -> None:
        self.host = host
        self.disk = disk
        self.moves: list[TierMove] = []  # copies between tiers the engine has yet to make, in order
        self.num_dropped_by_priority = 0  # blocks a lower tier would have kept but for their priority
        self.num_lacking_slices = 0  # cached blocks lacking window layers' slices (`windows.py`)
        self.blocks = [KvBlock(BlockId(i)) for i in range(num_blocks)]
        self.free_list: deque[KvBlock] = deque(self.blocks)
        self.cached: dict[BlockHash, KvBlock] = {}
        self.num_cached_free = 0
        self.events = events
        self.clock = clock
        self.queue = EvictionQueue(use_priority, self._emit_updated, num_blocks)
        self._tick = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones plus every cached-free one (all evictable in turn)."""
        return len(self.free_list) + self.num_cached_free

    def lookup(self, block_hash: BlockHash) -> KvBlock | None:
        return self.cached.get(block_hash)

    def ref(self, block: KvBlock) -> None:
        """Take one more owner; a cached-free block is revived (no longer evictable)."""
        if block.ref_count == 0:
            self.num_cached_free -= 1
            self.queue.invalidate(block)
        block.ref_count += 1

    def unref(self, block: KvBlock, last_used: int | None = None) -> None:
        """Drop one owner; at zero a cached block stays cached (evictable when a leaf), others go free.

        `last_used` restores an earlier LRU position (rolling back a claim) instead of taking a new tick.
        """
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is None:
            self.free_list.append(block)
            return
        if last_used is None:
            self._tick += 1
            last_used = self._tick
        block.last_used = last_used
        self.num_cached_free += 1
        if block.num_children == 0:
            self.queue.push(block)
            self.queue.compact()

    def allocate(self, num: int) -> list[KvBlock]:
        """`num` blocks with one owner each, evicting cached-free leaves as needed; all or nothing."""
        if num > self.num_available:
            raise OutOfBlocksError(num, self.num_available)
        taken = []
        for _ in range(num):
            block = self.free_list.popleft() if self.free_list else self._evict_one()
            block.ref_count = 1
            block.readable_from = None
            taken.append(block)
        return taken

    def publish(self, block: KvBlock, block_hash: BlockHash, parent: KvBlock | None, priority: int, expires_at: float | None,
                lora_id: int | None, onboarded: Tier | None = None) -> None:
        """Make an in-use block findable by `block_hash` (its KV must already be written, or, when
        `onboarded` from a lower tier, be copied from it by a move queued before any reader)."""
        block.block_hash = block_hash
        block.parent = parent
        block.priority = priority
        block.priority_expires_at = expires_at
        block.tier = Tier.DEVICE
        if parent is not None:
            parent.num_children += 1
        self.num_lacking_slices += block.readable_from is not None
        self.cached[block_hash] = block
        self.queue.watch_expiry(block)
        if onboarded is not None:
            self.events.updated(block_hash, Tier.DEVICE, priority, onboarded)
        else:
            self.events.stored([block_hash], parent.block_hash if parent else None, block.tier, priority, lora_id)

    def set_priority(self, block: KvBlock, priority: int, expires_at: float | None) -> None:
        if (block.priority, block.priority_expires_at) == (priority, expires_at):
            return
        block.priority = priority
        block.priority_expires_at = expires_at
        self.queue.watch_expiry(block)
        self._emit_updated(block)
        if block.is_evictable:
            self.queue.push(block)

    def forget(self, block: KvBlock) -> None:
        """Make an in-use block unfindable (its KV is not what its key says); its owners keep it
        as a private block until they free it."""
        if block.num_children:  # its cached children name it as their parent: they go too
            for child in [b for b in self.blocks if b.parent is block and b.block_hash is not None]:
                self.forget(child)
        if block.ref_count == 0:
            self.num_cached_free -= 1
            self.queue.invalidate(block)
            self._uncache(block)
            self.free_list.append(block)
            return
        self._uncache(block)

    def clear_cached_free(self) -> None:
        """Evict every cached-free block (prefix-cache reset); in-use blocks are untouched."""
        while self.num_cached_free:
            self.free_list.append(self._evict_one(offload=False))

    def _evict_one(self, offload: bool = True) -> KvBlock:
        self.queue.expire(self.clock())
        block = self.queue.pop()
        if block is None:  # unreachable while the integrity invariants hold
            raise OutOfBlocksError(1, 0)
        self._uncache(block, self._tier_keeping(block) if offload else None)
        self.num_cached_free -= 1
        return block

    def _tier_keeping(self, block: KvBlock) -> Tier | None:
        """The lower tier that keeps an evicted block's key findable, if any."""
        if self._move_down(block):
            return Tier.HOST
        if self.disk is not None and block.block_hash in self.disk:
            return Tier.DISK
        return None

    def _move_down(self, block: KvBlock) -> bool:
        """Keep an evicted block in the host tier if it is there already or its priority lets it
        move down (queueing the copy); True if it stays findable there."""
        host, block_hash = self.host, block.block_hash
        if host is None or block_hash is None:
            return False
        if block_hash in host:
            host.touch(block_hash)
            return True
        if block.readable_from is not None:  # lacks slices: the lower tiers hold only whole blocks
            return False
        if not host.admits(block.priority):
            self.num_dropped_by_priority += 1
            return False
        taken = host.take_slot()
        if taken is None:  # every entry is pinned by the claim in progress
            return False
        slot, dropped, dropped_entry = taken
        if dropped is not None and dropped_entry is not None:
            self.keep_on_disk(dropped, dropped_entry)  # its spill is queued before the slot is reused
        parent = block.parent.block_hash if block.parent is not None else None
        host.add(block_hash, slot, parent, block.priority, None)
        self.moves.append(TierMove(MoveKind.OFFLOAD, block.block_id, slot))
        return True

    def keep_on_disk(self, block_hash: BlockHash, entry: TierEntry) -> None:
        """The host tier evicted `entry`: keep it on disk if it is there or may move there."""
        disk = self.disk
        on_disk = disk is not None and block_hash in disk
        if on_disk:
            disk.touch(block_hash)  # type: ignore[union-attr]
        elif disk is not None and not disk.admits(entry.priority):
            self.num_dropped_by_priority += 1
        elif disk is not None and (taken := disk.take_slot()) is not None:
            slot, dropped, _ = taken
            if dropped is not None:
                self.moves.append(TierMove(MoveKind.DELETE, BlockId(-1), -1, dropped))
                if dropped not in self.cached and (self.host is None or dropped not in self.host):
                    self.events.removed([dropped], Tier.DISK)
            disk.add(block_hash, slot, entry.parent, entry.priority, None)
            self.moves.append(TierMove(MoveKind.SPILL, BlockId(-1), entry.slot, block_hash, entry.priority,
                                       entry.parent))
            on_disk = True
        if block_hash not in self.cached:  # the device does not hold it either
            if on_disk:
                self.events.updated(block_hash, Tier.DISK, entry.priority, Tier.HOST)
            else:
                self.events.removed([block_hash], Tier.HOST)

    def _uncache(self, block: KvBlock, kept_in: Tier | None = None) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        self.num_lacking_slices -= block.readable_from is not None
        if kept_in is not None:
            self.events.updated(block.block_hash, kept_in, block.priority, Tier.DEVICE)
        else:
            self.events.removed([block.block_hash], block.tier)
        parent = block.parent
        block.block_hash = None
        block.parent = None
        block.priority_expires_at = None
        if parent is not None:
            parent.num_children -= 1
            if parent.is_evictable:
                self.queue.push(parent)

    def _emit_updated(self, block: KvBlock) -> None:
        if block.block_hash is not None:
            self.events.updated(block.block_hash, block.tier, block.priority)
