"""Events with sequence numbers, a bounded buffer, and rejected calls that change nothing."""
import pytest

from pdserve.common.errors import DuplicateRequestError, InvalidRequestError, UnknownRequestError
from pdserve.kvcache import AllCleared, BlockRemoved, BlockStored, Tier
from tests.unit.kvcache.conftest import make_manager, make_request, run_to_completion


def test_stored_and_removed_events_are_numbered_in_order():
    m = make_manager(num_blocks=2)
    run_to_completion(m, make_request("a", range(8)))
    m.add_sequence(make_request("b", range(100, 104)))  # evicts a's leaf (block 1)
    events = m.drain_events()
    assert [e.seq for e in events] == [0, 1, 2]
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert events[1].parent_hash == events[0].block_hashes[0]
    assert events[2].block_hashes == events[1].block_hashes and events[2].tier == Tier.DEVICE
    assert m.drain_events() == []


def test_buffer_is_bounded_and_drops_the_oldest():
    m = make_manager(num_blocks=8, event_buffer_max_size=2)
    run_to_completion(m, make_request("a", range(16)))
    assert [e.seq for e in m.drain_events()] == [2, 3]  # 0 and 1 dropped: the gap is visible
    assert m.events.num_dropped == 2


def test_disabled_events_record_nothing():
    m = make_manager(num_blocks=8, event_buffer_max_size=0)
    run_to_completion(m, make_request("a", range(16)))
    assert m.drain_events() == []


def test_reset_prefix_cache_clears_and_emits_cleared():
    m = make_manager(num_blocks=4)
    run_to_completion(m, make_request("a", range(8)))
    m.add_sequence(make_request("busy", range(100, 104)))
    assert not m.reset_prefix_cache()
    m.free("busy")
    m.drain_events()
    assert m.reset_prefix_cache() and len(m.pool.cached) == 0
    events = m.drain_events()
    assert isinstance(events[-1], AllCleared) and m.num_free_blocks == 4
    m.check_integrity()


def _state(m):
    return ([(b.ref_count, b.block_hash, b.priority) for b in m.pool.blocks], list(m.pool.free_list),
            m.events.next_seq, m.num_free_blocks)


@pytest.mark.parametrize("bad,match", [
    ({"priorities": [(0, 4, 101)]}, r"priority=101: retention priority must be an integer in 0..100"),
    ({"priorities": [(0, 4, -1)]}, r"priority=-1"),
    ({"priorities": [(0, 6, 50), (4, 8, 60)]}, r"priority ranges \[0, 6\) and \[4, 8\) overlap"),
    ({"priorities": [(4, 4, 50)]}, r"priority range \[4, 4\) is empty"),
    ({"priorities": [(0, 4, 50, 0.0)]}, r"priority.duration=0.0"),
    ({"priorities": [(0, 4, 50, float("inf"))]}, r"priority.duration=inf: duration must be more than 0 and at most"),
    ({"decode_duration_s": 1e12}, r"decode_duration_s=1000000000000.0"),
    ({"decode_priority": 200}, r"decode_priority=200"),
])
def test_bad_priorities_are_rejected_without_state_change(bad, match):
    m = make_manager(num_blocks=4)
    run_to_completion(m, make_request("warm", range(8)))
    before = _state(m)
    with pytest.raises(InvalidRequestError, match=match):
        m.add_sequence(make_request("a", range(8), **bad))
    with pytest.raises(InvalidRequestError, match=match):
        m.analyze_prefix_reuse(make_request("a", range(8), **bad))
    assert _state(m) == before and not m.has_request("a")


def test_bad_request_in_a_batch_rejects_the_batch_before_any_claim():
    m = make_manager(num_blocks=8)
    before = _state(m)
    with pytest.raises(InvalidRequestError, match="token_ids is empty"):
        m.add_sequence_batch([make_request("ok", range(4)), make_request("bad", [])])
    assert _state(m) == before and not m.has_request("ok")


def test_duplicate_and_unknown_requests():
    m = make_manager(num_blocks=8)
    m.add_sequence(make_request("a", range(4)))
    before = _state(m)
    with pytest.raises(DuplicateRequestError, match="'a' is already held"):
        m.add_sequence(make_request("a", range(4)))
    with pytest.raises(DuplicateRequestError):
        m.add_sequence_batch([make_request("b", range(4)), make_request("b", range(4))])
    assert _state(m) == before
    m.free("a")
    with pytest.raises(UnknownRequestError, match="free: unknown request 'a'"):
        m.free("a")
    with pytest.raises(UnknownRequestError):
        m.allocate_slots("zzz", 1)
    m.check_integrity()
