"""Validation of the block ids (and layers) a transfer names, and the run count that bounds its cost."""
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
    layers: tuple[tuple[int, ...], ...] | None = None  # each pair's layers, ascending; None: whole blocks

    def layer_runs(self) -> np.ndarray:
        """(R, 4) int64 rows (local block, remote block, first layer, number of layers): each pair's
        layers as runs of consecutive layers, one contiguous copy each (a layer's K and V lie
        together in a block)."""
        rows = []
        for local, remote, layers in zip(self.local.tolist(), self.remote.tolist(), self.layers or ()):
            first = previous = layers[0]
            for layer in layers[1:] + (None,):
                if layer != previous + 1:
                    rows.append((local, remote, first, previous - first + 1))
                    first = layer
                previous = layer
        return np.array(rows, dtype=np.int64).reshape(-1, 4)

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
                   num_remote_blocks: int, layers: Sequence[Sequence[int]] | None = None,
                   num_layers: int = 0) -> BlockPairs:
    """Validate a transfer's ids (and, when given, each pair's layers among `num_layers`); the
    destination is remote for WRITE, local for READ.

    Raises InvalidRequestError naming the argument for empty or unequal lists, non-integer
    ids, ids out of `[0, num_blocks)`, a destination id given twice, or a pair's layers empty,
    out of range or not ascending.
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
    return BlockPairs(local, remote, None if layers is None else _as_layers(layers, len(local), num_layers))


def _as_layers(layers: Sequence[Sequence[int]], num_pairs: int, num_layers: int) -> tuple[tuple[int, ...], ...]:
    if len(layers) != num_pairs:
        raise InvalidRequestError(f"layers has {len(layers)} entries for {num_pairs} block pairs", param="layers")
    checked = tuple(tuple(pair) for pair in layers)
    for pair in checked:
        is_valid = bool(pair) and all(isinstance(x, int) and not isinstance(x, bool) for x in pair) \
            and 0 <= pair[0] and pair[-1] < num_layers and all(a < b for a, b in zip(pair, pair[1:]))
        if not is_valid:
            raise InvalidRequestError(f"layers {list(pair)}: must be ascending layer ids in [0, {num_layers}), "
                                      "at least one", param="layers")
    return checked


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
