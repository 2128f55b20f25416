"""Chunked context: grow chunk by chunk; a block is reusable only once full and computed."""
import pytest

from pdserve.common.errors import InvalidRequestError, OutOfBlocksError
from tests.unit.kvcache.conftest import make_manager, make_request


def test_sequence_grows_chunk_by_chunk():
    m = make_manager(num_blocks=8)
    r = make_request("a", range(14), num_claim_tokens=5)
    assert m.add_sequence(r).block_ids == (0, 1)
    m.mark_computed("a", 5)
    assert m.allocate_slots("a", 5) == [2]  # 10 tokens need 3 blocks
    m.mark_computed("a", 5)
    assert m.allocate_slots("a", 4) == [3]
    m.mark_computed("a", 4)
    assert m.num_computed_tokens("a") == 14 and m.block_ids("a") == [0, 1, 2, 3]
    m.check_integrity()


def test_block_is_published_only_when_full_and_computed():
    m = make_manager(num_blocks=8)
    m.add_sequence(make_request("a", range(12)))  # blocks reserved for the whole prompt
    probe = make_request("probe", list(range(12)) + [0])
    assert m.analyze_prefix_reuse(probe).num_cached_blocks == 0  # reserved is not computed
    m.mark_computed("a", 3)
    assert m.analyze_prefix_reuse(probe).num_cached_blocks == 0  # block 0 not full yet
    m.mark_computed("a", 3)
    assert m.analyze_prefix_reuse(probe).num_cached_blocks == 1
    m.mark_computed("a", 6)
    assert m.analyze_prefix_reuse(probe).num_cached_blocks == 3
    assert [e.seq for e in m.drain_events()] == [0, 1, 2]


def test_decode_blocks_are_published_as_they_fill():
    m = make_manager(num_blocks=8)
    m.add_sequence(make_request("a", range(6)))
    m.mark_computed("a", 6)
    for token in (6, 7, 8):
        m.allocate_slots("a", 1)
        m.append_tokens("a", [token])
        m.mark_computed("a", 1)
    assert len(m.pool.cached) == 2  # tokens 0..7 fill two blocks
    assert m.analyze_prefix_reuse(make_request("b", range(10))).num_cached_tokens == 8


def test_cannot_mark_more_than_known_or_reserved():
    m = make_manager(num_blocks=8)
    m.add_sequence(make_request("a", range(6), num_claim_tokens=4))
    with pytest.raises(InvalidRequestError, match="0 computed, limit 4"):
        m.mark_computed("a", 5)
    assert m.num_computed_tokens("a") == 0


def test_growth_beyond_capacity_changes_nothing():
    m = make_manager(num_blocks=2)
    m.add_sequence(make_request("a", range(8)))
    m.mark_computed("a", 8)
    with pytest.raises(OutOfBlocksError, match="need 1 blocks, only 0"):
        m.allocate_slots("a", 1)
    assert m.block_ids("a") == [0, 1]
    m.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    m = make_manager(num_blocks=8)
    m.add_sequence(make_request("a", range(6)))
    m.mark_computed("a", 6)
    claim, copy = m.fork("a", make_request("a#1", range(6)))
    assert claim.block_ids == (0, 2) and copy == (1, 2)
    assert m.pool.blocks[0].ref_count == 2
    assert m.num_computed_tokens("a#1") == 6
    m.check_integrity()
    m.free("a")
    m.free("a#1")
    m.check_integrity()
