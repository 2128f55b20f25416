"""Blocks received without some window layers' slices (`lack_slices`): published, but a prefix hit
stops short of a query that would read a missing slice; a whole copy takes their key; they never
move down a tier."""
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.kvcache import BlockRemoved, Tier
from pdserve.kvcache.windows import SlidingWindows
from tests.unit.kvcache.conftest import make_manager, make_request, run_to_completion

TPB = 4
MISTRAL = SlidingWindows((8, 8), TPB)  # every layer has a window of 8
PROMPT = list(range(100, 124))  # 24 tokens, 6 blocks: the receiver's first query is at 24


def receive(manager, rid: str, tokens: list[int], windows: SlidingWindows = MISTRAL) -> list:
    """A decode worker's remote prefill: claim, the blocks land without the slices out of reach,
    publish, free. The slices the peer skipped."""
    request = make_request(rid, tokens)
    claim = manager.add_sequence(request)
    first_block = claim.num_cached_tokens // TPB
    skipped = windows.skipped(len(tokens), first_block, len(claim.block_ids) - first_block)
    manager.lack_slices(request.request_id, skipped)
    manager.mark_computed(request.request_id, len(tokens) - claim.num_cached_tokens)
    manager.free(request.request_id)
    manager.check_integrity()
    return list(skipped)


def test_received_blocks_are_published_marked_with_the_first_query_that_may_read_them():
    manager = make_manager(num_blocks=16, tokens_per_block=TPB)
    skipped = receive(manager, "r", PROMPT)
    assert [(s.block_index, s.readable_from) for s in skipped] == [(0, 11), (1, 15), (2, 19), (3, 23)]
    hashes = make_request("x", PROMPT).block_hashes(TPB)
    assert [manager.pool.lookup(h).readable_from for h in hashes] == [11, 15, 19, 23, None, None]


def test_a_continuation_past_the_window_reuses_the_whole_prefix():
    manager = make_manager(num_blocks=16, tokens_per_block=TPB)
    receive(manager, "r", PROMPT)
    claim = manager.add_sequence(make_request("turn2", PROMPT + list(range(300, 309))))
    assert claim.num_cached_tokens == 24  # its first query, 24, reads none of the missing slices


def test_a_prompt_diverging_within_the_window_gets_no_hit_on_the_blocks_it_would_read():
    manager = make_manager(num_blocks=16, tokens_per_block=TPB)
    receive(manager, "r", PROMPT)
    diverging = PROMPT[:20] + list(range(400, 410))  # shares 5 blocks; would compute from 20 on
    assert manager.analyze_prefix_reuse(make_request("a", diverging)).num_cached_tokens == 0
    claim = manager.add_sequence(make_request("d", diverging))
    assert claim.num_cached_tokens == 0  # from 20 on a query reads block 3 (readable from 23), from 4 on block 0


def test_a_cut_keeps_the_whole_blocks_before_a_slice_the_continuation_would_read():
    windows = SlidingWindows((4, None), TPB)  # a window of 4, then a global layer
    manager = make_manager(num_blocks=16, tokens_per_block=TPB)
    run_to_completion(manager, make_request("local", PROMPT[:9]))  # blocks 0 and 1 whole, here
    skipped = receive(manager, "r", PROMPT, windows)  # the peer sends blocks 2..5
    assert [(s.block_index, s.layers, s.readable_from) for s in skipped] == [(2, (0,), 15), (3, (0,), 19),
                                                                            (4, (0,), 23)]
    claim = manager.add_sequence(make_request("d", PROMPT[:16] + list(range(400, 410))))
    assert claim.num_cached_tokens == 8  # from 16 on a query reads block 3, from 12 on block 2


def test_a_whole_copy_takes_the_key_from_a_block_lacking_slices():
    manager = make_manager(num_blocks=16, tokens_per_block=TPB)
    receive(manager, "r", PROMPT)
    assert manager.pool.num_lacking_slices == 4
    run_to_completion(manager, make_request("local", PROMPT[:20] + [7, 7, 7, 7]))  # computes blocks 0..4 whole
    assert manager.pool.num_lacking_slices == 0
    hashes = make_request("x", PROMPT).block_hashes(TPB)
    assert [manager.pool.lookup(h).readable_from for h in hashes[:5]] == [None] * 5
    claim = manager.add_sequence(make_request("again", PROMPT[:20] + [9, 9]))
    assert claim.num_cached_tokens == 20
    manager.check_integrity()


def test_a_block_lacking_slices_is_dropped_not_offloaded_when_evicted():
    manager = make_manager(num_blocks=6, tokens_per_block=TPB, num_host_blocks=8, num_disk_blocks=8)
    receive(manager, "r", PROMPT)
    manager.drain_events()
    run_to_completion(manager, make_request("other", list(range(500, 524))))  # evicts all six
    offloaded = {m.block_id for m in manager.drain_tier_moves()}
    hashes = make_request("x", PROMPT).block_hashes(TPB)
    assert [h in manager.host for h in hashes] == [False] * 4 + [True] * 2
    assert len(offloaded) == 2
    removed = [h for e in manager.drain_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(hashes[:4]) <= set(removed)
    assert manager.cached_blocks_by_tier().count((hashes[4], Tier.HOST)) == 1
    manager.spill_host_tier()  # a stop: the host tier goes to disk, whole blocks only
    assert [h in manager.disk for h in hashes] == [False] * 4 + [True] * 2
    manager.check_integrity()


def test_a_published_block_cannot_be_marked():
    manager = make_manager(num_blocks=16, tokens_per_block=TPB)
    run_to_completion(manager, make_request("local", PROMPT))
    request = make_request("r", PROMPT + [1, 2, 3, 4])
    manager.add_sequence(request)  # blocks 0..4 are matched, published
    with pytest.raises(InvalidRequestError, match="published already"):
        manager.lack_slices(request.request_id, MISTRAL.skipped(len(request.token_ids), 0, 7))


def test_a_holder_of_a_block_a_whole_copy_replaced_publishes_no_block_under_it():
    manager = make_manager(num_blocks=16, tokens_per_block=TPB)
    request = make_request("r", PROMPT)
    manager.add_sequence(request)
    manager.lack_slices(request.request_id, MISTRAL.skipped(24, 0, 6))
    manager.mark_computed(request.request_id, 24)  # still decoding: it holds its blocks
    run_to_completion(manager, make_request("local", PROMPT[:8] + [7]))  # blocks 0 and 1 whole: they take the keys
    manager.allocate_slots(request.request_id, 4)
    manager.append_tokens(request.request_id, [1, 2, 3, 4])
    manager.mark_computed(request.request_id, 4)  # block 6 is full, its parent no longer cached
    manager.check_integrity()
    assert manager.pool.lookup(make_request("x", PROMPT + [1, 2, 3, 4]).block_hashes(TPB)[6]) is None
