"""A physical KV block's bookkeeping record, and the storage tiers a cached block can live in."""
import enum
from dataclasses import dataclass

from pdserve.common.ids import BlockHash, BlockId
from pdserve.common.request import DEFAULT_RETENTION_PRIORITY


class Tier(enum.IntEnum):
    """Where a cached block's bytes live. Lower tiers are larger and slower."""

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(slots=True, eq=False)
class KvBlock:
    """One block. States (exactly one holds):

    - free: `ref_count == 0` and `block_hash is None`; it sits in the pool's free list;
    - cached-free: `ref_count == 0` and `block_hash` set; reusable by a prefix hit, evictable once it is
      a leaf (`num_children == 0`);
    - in use: `ref_count > 0`; owned by `ref_count` sequences (and, when published, findable by hash).
    """

    block_id: BlockId
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent: "KvBlock | None" = None  # the cached block holding the previous block of the prefix
    num_children: int = 0  # cached blocks whose parent is this one
    priority: int = DEFAULT_RETENTION_PRIORITY
    priority_expires_at: float | None = None
    tier: Tier = Tier.DEVICE
    last_used: int = 0  # logical clock tick of the last release
    version: int = 0  # bumped whenever an eviction-queue entry for this block goes stale
    # Received without some window layers' slices: only queries from this position on may read
    # it (windows.py). None: its KV is whole.
    readable_from: int | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    @property
    def is_evictable(self) -> bool:
        return self.ref_count == 0 and self.block_hash is not None and self.num_children == 0
