"""A worker's lower KV tiers: the host tier's slots and, below them, the disk tier's files.

Built at start from the settings: the host tier's tensor, the disk folder of this model's
fingerprint, whose block files from an earlier run are taken over (announced as events, each
checked at its first hit). `KvTierStore.apply` makes the KV cache manager's moves in order.
"""
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.common.errors import TransferError
from pdserve.common.ids import BlockHash, BlockId
from pdserve.engine.model.host_store import HostKvStore
from pdserve.kvcache import KvCacheManager
from pdserve.kvcache.lower_tier import MoveKind, TierMove
from pdserve.transfer.disk_store import DiskKvStore

log = logging.getLogger(__name__)


@dataclass
class KvTierStore:
    kv_tensor: torch.Tensor
    host: HostKvStore
    disk: DiskKvStore | None = None

    def apply(self, moves: Sequence[TierMove]) -> list[BlockId]:
        """Make the moves in order. A failed disk read (a file gone, unreadable, or whose bytes do
        not match its header) leaves its device block listed (the engine has it recomputed) and
        removes the file; a failed write leaves the block out of the disk tier (a miss later)."""
        unread = []
        for move in moves:
            if move.kind in (MoveKind.OFFLOAD, MoveKind.ONBOARD):
                self.host.apply((move,))
                continue
            assert self.disk is not None and move.block_hash is not None, move
            try:
                if move.kind is MoveKind.SPILL:
                    self.disk.spill(move.slot, move.block_hash, move.parent, move.priority)
                elif move.kind is MoveKind.LOAD:
                    self.disk.load_into(move.block_hash, self.kv_tensor[move.block_id])
                else:
                    self.disk.files.delete(move.block_hash)
            except (OSError, TransferError) as exc:
                log.warning("disk KV tier: %s of block %s failed: %s", move.kind.value, move.block_hash.hex()[:16], exc)
                if move.kind is MoveKind.LOAD:
                    unread.append(move.block_id)
                    self.disk.files.delete(move.block_hash)  # a miss from now on, never read again
        return unread

    def verify(self, block_hash: BlockHash) -> bool:
        return self.disk is not None and self.disk.files.verify(block_hash)


def adopt_disk_blocks(kv: KvCacheManager, store: KvTierStore) -> None:
    """Take over the block files an earlier run left, as many as the disk tier holds."""
    if store.disk is None:
        return
    records = store.disk.files.scan()
    taken = kv.adopt_disk_blocks([(r.block_hash, r.parent, r.priority) for r in records])
    log.info("disk KV tier: %d blocks found in %s, %d taken over%s", len(records), store.disk.files.folder, taken,
             "" if taken == len(records) else " (the tier is full; the rest are left on disk)")
