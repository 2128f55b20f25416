"""Validation of the block ids a transfer names, and the run count that bounds its cost."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pdserve.common.errors import InvalidRequestError
from pdserve.common.ids import BlockId


@dataclass(frozen=True, slots=True)
class BlockPairs:
    """`local[i]` moves to or from `remote[i]`; both int32 arrays of one length >= 1.

    Contract: every id is in range for its side and no destination id repeats, so no two
    pairs write the same block.
    """

    local: np.ndarray
    remote: np.ndarray

    @property
    def num_runs(self) -> int:
        """Pairs that continue both sides' previous pair (`local` +1 and `remote` +1) join its
        run; a run is one contiguous copy, the descriptor count after merging."""
        if len(self.local) == 1:
            return 1
        is_continued = (np.diff(self.local) == 1) & (np.diff(self.remote) == 1)
        return 1 + int(np.count_nonzero(~is_continued))


def pair_block_ids(op: Literal["WRITE", "READ"], local_block_ids: Sequence[BlockId],
                   remote_block_ids: Sequence[BlockId], num_local_blocks: int,
                   num_remote_blocks: int) -> BlockPairs:
    """Validate a transfer's ids; the destination is remote for WRITE, local for READ.

    Raises InvalidRequestError naming the argument for empty or unequal lists, non-integer
    ids, ids out of `[0, num_blocks)` or a destination id given twice.
    """
    local = _as_ids("local_block_ids", local_block_ids, num_local_blocks)
    remote = _as_ids("remote_block_ids", remote_block_ids, num_remote_blocks)
    if len(local) != len(remote):
        raise InvalidRequestError(
            f"local_block_ids has {len(local)} ids but remote_block_ids has {len(remote)}",
            param="remote_block_ids")
    name, destination = ("remote_block_ids", remote) if op == "WRITE" else ("local_block_ids", local)
    unique, counts = np.unique(destination, return_counts=True)
    if len(unique) != len(destination):
        repeated = unique[counts > 1].tolist()
        raise InvalidRequestError(f"{name} repeats destination blocks {repeated}", param=name)
    return BlockPairs(local, remote)


def _as_ids(name: str, block_ids: Sequence[BlockId], num_blocks: int) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or len(ids) == 0:
        raise InvalidRequestError(f"{name} must be a non-empty list of block ids, got {block_ids!r}",
                                  param=name)
    if ids.dtype.kind not in "iu":
        raise InvalidRequestError(f"{name} must hold integers, got dtype {ids.dtype}", param=name)
    out_of_range = ids[(ids < 0) | (ids >= num_blocks)]
    if len(out_of_range):
        raise InvalidRequestError(
            f"{name} {out_of_range.tolist()} out of range [0, {num_blocks})", param=name)
    return ids.astype(np.int32)
