"""Blocks and pool, prefix reuse, analysis and the two-phase claim, with exact values."""
import pytest

from pdserve.common.errors import OutOfBlocksError
from tests.unit.kvcache.conftest import make_manager, make_request, run_to_completion


def test_claim_allocates_blocks_in_order_with_one_owner():
    m = make_manager(num_blocks=8)
    claim = m.add_sequence(make_request("a", range(10)))
    assert claim.block_ids == (0, 1, 2) and claim.num_cached_tokens == 0
    assert [m.pool.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert m.num_free_blocks == 5
    m.check_integrity()


def test_freed_blocks_keep_their_key_and_a_later_hit_revives_them():
    m = make_manager(num_blocks=8)
    run_to_completion(m, make_request("a", range(10)))
    assert m.num_free_blocks == 8 and len(m.pool.cached) == 2  # two full blocks cached, partial one freed
    claim = m.add_sequence(make_request("b", list(range(8)) + [50, 51, 52]))
    assert claim.block_ids == (0, 1, 3) and claim.num_cached_tokens == 8
    assert [m.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    m.check_integrity()


def test_full_prompt_hit_still_computes_the_last_token():
    m = make_manager(num_blocks=8)
    run_to_completion(m, make_request("a", range(8)))
    analysis = m.analyze_prefix_reuse(make_request("b", range(8)))
    assert (analysis.num_cached_blocks, analysis.num_cached_tokens, analysis.num_new_blocks) == (1, 4, 1)
    claim = m.add_sequence(make_request("b", range(8)))
    assert claim.num_cached_tokens == 4 and claim.block_ids == (0, 2)
    m.mark_computed("b", 4)  # recomputed block 1 is a duplicate of cached block 1: shared, ours freed
    assert m.block_ids("b") == [0, 1]
    m.check_integrity()


def test_a_request_that_needs_its_prompt_computed_skips_the_cache_yet_publishes_its_blocks():
    m = make_manager(num_blocks=8)
    run_to_completion(m, make_request("a", range(10)))
    b = make_request("b", range(10), reuse_cached_prefix=False)
    assert m.analyze_prefix_reuse(b).num_cached_tokens == 0
    claim = m.add_sequence(b)
    assert claim.block_ids == (3, 4, 5) and claim.num_cached_tokens == 0  # cached blocks 0, 1 untouched
    m.mark_computed(b.request_id, 10)
    assert m.block_ids(b.request_id) == [0, 1, 5]  # same keys: the cached copies are shared, ours freed
    m.free(b.request_id)
    assert m.add_sequence(make_request("c", range(10))).num_cached_tokens == 8
    m.check_integrity()


def test_shared_prefix_is_owned_by_both_requests():
    m = make_manager(num_blocks=8)
    run_to_completion(m, make_request("warm", range(9)))
    m.add_sequence_batch([make_request("a", range(9)), make_request("b", list(range(8)) + [99])])
    assert m.pool.blocks[0].ref_count == 2 and m.pool.blocks[1].ref_count == 2
    m.check_integrity()


def test_analysis_reports_what_the_claim_then_does():
    m = make_manager(num_blocks=4)
    run_to_completion(m, make_request("a", range(12)))
    request = make_request("b", list(range(8)) + [7] * 8)
    analysis = m.analyze_prefix_reuse(request)
    assert analysis.num_cached_blocks == 2 and analysis.num_new_blocks == 2
    assert analysis.num_available_blocks == 2 and analysis.fits  # 4 total - 2 revived
    assert analysis.num_cached_by_tier == (2, 0, 0)
    claim = m.add_sequence(request)
    assert claim.num_cached_tokens == analysis.num_cached_tokens == 8
    too_big = make_request("c", range(100, 120))
    assert not m.analyze_prefix_reuse(too_big).fits


def test_reuse_disabled_never_matches():
    m = make_manager(num_blocks=8, enable_block_reuse=False)
    run_to_completion(m, make_request("a", range(12)))
    assert m.analyze_prefix_reuse(make_request("b", range(12))).num_cached_blocks == 0
    assert m.add_sequence(make_request("b", range(12))).num_cached_tokens == 0
    assert len(m.pool.cached) == 0


def test_salt_lora_and_image_isolate_identical_tokens():
    from pdserve.common.request import MultimodalSpan
    m = make_manager(num_blocks=16)
    run_to_completion(m, make_request("a", range(9), cache_salt="t1", lora_id=1))
    for kw in ({"cache_salt": "t2", "lora_id": 1}, {"cache_salt": "t1", "lora_id": 2},
               {"cache_salt": "t1", "lora_id": 1, "multimodal": (MultimodalSpan(b"img", 0, 4),)}):
        assert m.analyze_prefix_reuse(make_request("x", range(9), **kw)).num_cached_blocks == 0
    assert m.analyze_prefix_reuse(make_request("x", range(9), cache_salt="t1", lora_id=1)).num_cached_blocks == 2


def _two_phase_setup():
    """4 blocks: block 0 caches A's prefix (least recently used), blocks 2-3 cache another prefix, 1 free."""
    m = make_manager(num_blocks=4)
    run_to_completion(m, make_request("x", range(5)))
    run_to_completion(m, make_request("y", range(200, 209)))
    assert [b.block_id for b in m.pool.free_list] == [1] and m.pool.num_cached_free == 3
    return m, make_request("a", range(6)), make_request("b", range(100, 108))


def test_two_phase_claim_keeps_a_matched_block_that_one_at_a_time_would_evict():
    """B's allocation would evict the LRU cached block that A matched.

    One request at a time (B first) A loses its hit; with the batch claim A keeps it and its cached
    token count equals the analysis made before the claim.
    """
    m, a, b = _two_phase_setup()
    assert m.analyze_prefix_reuse(a).num_cached_tokens == 4
    m.add_sequence(b)
    assert m.block_ids("b") == [1, 0]  # the free block, then the evicted LRU block A wanted
    assert m.add_sequence(a).num_cached_tokens == 0
    m.check_integrity()

    m, a, b = _two_phase_setup()
    analysis = m.analyze_prefix_reuse(a)
    claims = m.add_sequence_batch([b, a])
    assert claims[1].num_cached_tokens == analysis.num_cached_tokens == 4
    assert claims[0].block_ids == (1, 3) and claims[1].block_ids == (0, 2)
    m.check_integrity()


def test_batch_claim_is_all_or_nothing():
    m = make_manager(num_blocks=4)
    run_to_completion(m, make_request("warm", range(5)))
    before = (m.num_free_blocks, [b.ref_count for b in m.pool.blocks], m.pool.blocks[0].last_used)
    with pytest.raises(OutOfBlocksError, match="need 5 blocks, only 3"):
        m.add_sequence_batch([make_request("a", range(6)), make_request("b", range(100, 116))])
    assert (m.num_free_blocks, [b.ref_count for b in m.pool.blocks], m.pool.blocks[0].last_used) == before
    assert not m.has_request("a") and not m.has_request("b")
    assert m.drain_events()[-1].seq == 0  # only the warm-up's stored event; nothing evicted
    m.check_integrity()
