"""Which slices of a prompt's blocks a hand-off leaves behind, and how far a hit on such blocks
may be reused (`kvcache/windows.py`), checked against the attention mask itself."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.errors import ConfigError
from pdserve.kvcache.windows import SkippedSlices, SlidingWindows, num_reusable


def attends(query: int, key: int, window: int | None) -> bool:
    """The mask of attention.py: causal, and on a window layer keys > query - window."""
    return key <= query and (window is None or key > query - window)


def test_every_layer_windowed_leaves_whole_blocks_behind():
    # Mistral: window 8 on both layers; a 24-token prompt, so the first query is at 24 and
    # reaches keys 17.. only: blocks 0..3 (positions 0..15, then 16 the last out of reach).
    skipped = SlidingWindows((8, 8), 4).skipped(prompt_len=24, first_block=0, num_blocks=6)
    assert skipped == tuple(SkippedSlices(b, (0, 1), 4 * b + 3 + 8) for b in range(4))


def test_a_global_layer_always_travels():
    skipped = SlidingWindows((8, None), 4).skipped(prompt_len=24, first_block=0, num_blocks=6)
    assert [(s.block_index, s.layers) for s in skipped] == [(0, (0,)), (1, (0,)), (2, (0,)), (3, (0,))]


def test_blocks_the_receiver_holds_already_are_not_named():
    skipped = SlidingWindows((8, 8), 4).skipped(prompt_len=24, first_block=2, num_blocks=4)
    assert [s.block_index for s in skipped] == [2, 3]


def test_layers_of_shorter_windows_stay_behind_on_more_blocks():
    skipped = SlidingWindows((4, None, 8), 4).skipped(prompt_len=24, first_block=0, num_blocks=6)
    assert [(s.block_index, s.layers, s.readable_from) for s in skipped] == [
        (0, (0, 2), 11), (1, (0, 2), 15), (2, (0, 2), 19), (3, (0, 2), 23), (4, (0,), 23)]


@pytest.mark.parametrize(("prompt_len", "num_skipped"), [(22, 3), (23, 4), (26, 4), (27, 5), (28, 5)])
def test_the_edge_is_exact(prompt_len, num_skipped):
    # block b's last position 4b+3 must be <= prompt_len - 8
    assert len(SlidingWindows((8,), 4).skipped(prompt_len, 0, 8)) == num_skipped


def test_no_window_layers_skip_nothing():
    assert SlidingWindows((None, None), 4).skipped(100, 0, 25) == ()
    assert SlidingWindows((), 16).skipped(100, 0, 7) == ()


@pytest.mark.parametrize("windows", [(0,), (-3, None), (True,), (2.5,)])
def test_a_window_must_be_a_positive_integer(windows):
    with pytest.raises(ConfigError):
        SlidingWindows(windows, 4)


@settings(deadline=None)
@given(windows=st.lists(st.one_of(st.none(), st.integers(1, 40)), min_size=1, max_size=4),
       tpb=st.sampled_from([1, 2, 4, 8]), prompt_len=st.integers(1, 80), first_block=st.integers(0, 10))
def test_a_slice_stays_behind_exactly_when_no_query_from_prompt_len_on_attends_its_block(
        windows, tpb, prompt_len, first_block):
    num_prompt_blocks = -(-prompt_len // tpb)
    first_block = min(first_block, num_prompt_blocks - 1)
    skipped = {s.block_index: s for s in SlidingWindows(windows, tpb).skipped(
        prompt_len, first_block, num_prompt_blocks - first_block)}
    queries = range(prompt_len, prompt_len + 3 * max([w or 0 for w in windows] + [tpb]) + 2)
    for block in range(first_block, num_prompt_blocks):
        keys = range(block * tpb, (block + 1) * tpb)  # a partial last block fills as the receiver decodes
        reached = {layer for layer, w in enumerate(windows) if any(attends(q, k, w) for q in queries for k in keys)}
        left = skipped[block].layers if block in skipped else ()
        assert set(left) == set(range(len(windows))) - reached
        if block in skipped:  # past its keys, the first query (and so every later one) attending none left
            readable = next(q for q in range(keys[-1], prompt_len + 1)
                            if not any(attends(q, k, windows[layer]) for k in keys for layer in left))
            assert skipped[block].readable_from == readable


@pytest.mark.parametrize(("readable_from", "num_after", "expected"), [
    ([None, None, None], 2, 5),  # nothing lacks slices: the whole hit
    ([11, 15, None, None, None], 0, 5),  # computing from 20 on: blocks 0 and 1 are out of reach
    ([11, 15, None, None], 0, 4),  # from 16 on: 16 >= 15
    ([11, 15, None], 0, 0),  # from 12 on would read block 1, from 8 or 4 on block 0 too
    ([None, 15, None], 0, 1),  # cut before the block lacking slices
    ([11, None], 3, 5),  # whole lower-tier blocks after it count towards the first query
    ([11, None], 0, 0),
])
def test_a_hit_is_cut_where_a_query_left_to_compute_would_read_a_missing_slice(readable_from, num_after, expected):
    n = num_reusable(readable_from, num_after, 4)
    worst = max([r for r in readable_from[:n] if r is not None] + [0])
    assert worst <= n * 4
    assert n == expected
