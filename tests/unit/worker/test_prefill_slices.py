"""`prefill_service.slices_to_send`: which of a hand-off's blocks a prefill worker writes, with which layers."""
from pdserve.kvcache.windows import SlidingWindows
from pdserve.worker.prefill_service import slices_to_send

SOURCE, DEST = [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]


def test_without_windows_every_block_goes_whole():
    skipped = SlidingWindows((None, None), 4).skipped(24, 0, 6)
    assert slices_to_send(SOURCE, DEST, 0, skipped, 2) == (SOURCE, DEST, None)


def test_blocks_out_of_every_layers_reach_are_not_named_and_the_rest_go_whole():
    skipped = SlidingWindows((8, 8), 4).skipped(24, 0, 6)  # blocks 0..3
    assert slices_to_send(SOURCE, DEST, 0, skipped, 2) == ([14, 15], [24, 25], None)


def test_a_block_out_of_the_window_layers_reach_goes_with_its_global_layers():
    skipped = SlidingWindows((8, None, 4), 4).skipped(24, 2, 4)  # from block 2 on: 2, 3 lack 0 and 2; 4 lacks 2
    assert slices_to_send(SOURCE[2:], DEST[2:], 2, skipped, 3) == (
        [12, 13, 14, 15], [22, 23, 24, 25], [[1], [1], [0, 1], [0, 1, 2]])


def test_nothing_is_named_when_every_block_is_out_of_reach():
    skipped = SlidingWindows((1,), 4).skipped(8, 0, 2)  # a window of one: only a query's own key
    assert (len(skipped), slices_to_send(SOURCE[:2], DEST[:2], 0, skipped, 1)) == (2, ([], [], None))
