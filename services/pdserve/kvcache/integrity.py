"""`check_pool_integrity`: the pool's invariants, checked from scratch (tests call it after every step).

Linear in blocks: every lookup it makes is into a set, counter or dict built once per check
(the worker runs it on its engine thread, between steps).
"""
from collections import Counter
from collections.abc import Iterable

from pdserve.common.errors import PdserveError
from pdserve.kvcache.block import KvBlock
from pdserve.kvcache.pool import BlockPool


class IntegrityError(PdserveError):
    """The KV cache bookkeeping is inconsistent (a bug, never user input)."""


def check_pool_integrity(pool: BlockPool, owners: Iterable[list[KvBlock]]) -> None:
    """free + cached-free + in-use == total; ref counts equal live owners; no block in two places."""
    owned = Counter(id(b) for blocks in owners for b in blocks)
    free_ids = [id(b) for b in pool.free_list]
    _require(len(free_ids) == len(set(free_ids)), "a block appears twice in the free list")
    free_set = set(free_ids)
    num_cached_free = num_in_use = 0
    children = Counter(id(b.parent) for b in pool.blocks if b.block_hash is not None and b.parent is not None)
    queued = pool.queue.queued_blocks()
    for block in pool.blocks:
        name = f"block {block.block_id}"
        _require(block.ref_count == owned.get(id(block), 0),
                 f"{name}: ref_count {block.ref_count} != {owned.get(id(block), 0)} owners")
        _require(block.num_children == children.get(id(block), 0),
                 f"{name}: num_children {block.num_children} != {children.get(id(block), 0)}")
        in_free = id(block) in free_set
        if block.ref_count > 0:
            num_in_use += 1
            _require(not in_free, f"{name}: in use and in the free list")
        elif block.block_hash is not None:
            num_cached_free += 1
            _require(not in_free, f"{name}: cached and in the free list")
        else:
            _require(in_free, f"{name}: free but not in the free list")
        _check_cached(pool, block, queued)
    _require(num_cached_free == pool.num_cached_free,
             f"cached-free count {pool.num_cached_free} != actual {num_cached_free}")
    total = len(free_ids) + num_cached_free + num_in_use
    _require(total == pool.num_blocks, f"free {len(free_ids)} + cached-free {num_cached_free} + in-use {num_in_use} != {pool.num_blocks}")
    _require(len(pool.cached) == sum(1 for b in pool.blocks if b.block_hash is not None), "hash map size mismatch")
    lacking = sum(1 for b in pool.cached.values() if b.readable_from is not None)
    _require(pool.num_lacking_slices == lacking, f"{pool.num_lacking_slices} cached blocks lacking slices counted, "
             f"{lacking} held")


def _check_cached(pool: BlockPool, block: KvBlock, queued: set[KvBlock]) -> None:
    name = f"block {block.block_id}"
    if block.block_hash is None:
        _require(block.parent is None, f"{name}: uncached block keeps a parent")
        return
    _require(pool.cached.get(block.block_hash) is block, f"{name}: not findable under its own hash")
    if block.parent is not None:
        _require(block.parent.block_hash is not None, f"{name}: parent is not cached (unreachable block)")
    if block.is_evictable:
        _require(block in queued, f"{name}: evictable but not in the eviction queue")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)
