"""`check_integrity()` catches each kind of corrupted bookkeeping (the check is linear in blocks;
its cost is measured by benchmarks/kvcache_integrity.py, never asserted here)."""
import pytest

from pdserve.common.ids import BlockHash, BlockId
from pdserve.kvcache import IntegrityError
from pdserve.kvcache.block import KvBlock
from tests.unit.kvcache.conftest import make_manager, make_request, run_to_completion


def make_mixed_manager():
    """8 blocks: 0 a cached parent, 1 its cached-free leaf, 3-4 in use by "u", the rest free."""
    manager = make_manager(num_blocks=8, tokens_per_block=4)
    run_to_completion(manager, make_request("a", range(9)))
    manager.add_sequence(make_request("u", [50, 51, 52, 53, 54]))
    blocks = manager.pool.blocks
    assert (blocks[0].num_children, blocks[1].parent, blocks[1].is_evictable) == (1, blocks[0], True)
    assert manager.block_ids("u") == [3, 4]
    manager.check_integrity()
    return manager


def _uncache_parent_only(pool):
    parent = pool.blocks[0]
    del pool.cached[parent.block_hash]
    parent.block_hash = None
    pool.free_list.append(parent)


def _move_leaf_to_another_key(pool):
    leaf = pool.blocks[1]
    del pool.cached[leaf.block_hash]
    pool.cached[BlockHash(b"another key")] = leaf


CORRUPTIONS = {
    "twice in the free list": lambda pool: pool.free_list.append(pool.free_list[0]),
    "block 3: ref_count 2 != 1 owners": lambda pool: setattr(pool.blocks[3], "ref_count", 2),
    "block 0: num_children 2 != 1": lambda pool: setattr(pool.blocks[0], "num_children", 2),
    "block 3: in use and in the free list": lambda pool: pool.free_list.append(pool.blocks[3]),
    "block 1: cached and in the free list": lambda pool: pool.free_list.append(pool.blocks[1]),
    "block 2: free but not in the free list": lambda pool: pool.free_list.remove(pool.blocks[2]),
    "block 2: uncached block keeps a parent": lambda pool: setattr(pool.blocks[2], "parent", pool.blocks[0]),
    "block 1: not findable under its own hash": _move_leaf_to_another_key,
    "block 1: parent is not cached": _uncache_parent_only,
    "block 1: evictable but not in the eviction queue": lambda pool: pool.queue.invalidate(pool.blocks[1]),
    "cached-free count 3 != actual 2": lambda pool: setattr(pool, "num_cached_free", 3),
    "in-use 2 != 8": lambda pool: pool.free_list.append(KvBlock(BlockId(99))),
    "hash map size mismatch": lambda pool: pool.cached.__setitem__(BlockHash(b"extra"), pool.blocks[1]),
}


@pytest.mark.parametrize("message", CORRUPTIONS)
def test_each_corruption_is_caught(message):
    manager = make_mixed_manager()
    CORRUPTIONS[message](manager.pool)
    with pytest.raises(IntegrityError) as info:
        manager.check_integrity()
    assert message in str(info.value)


def test_a_stale_queue_entry_does_not_count_as_queued():
    manager = make_mixed_manager()
    leaf = manager.pool.blocks[1]
    assert manager.pool.queue.queued_blocks() == {leaf}
    manager.pool.queue.invalidate(leaf)
    assert manager.pool.queue.queued_blocks() == set()
