import numpy as np
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.transfer.blocks import pair_block_ids


def test_pairs_are_int32_arrays_in_the_given_order() -> None:
    pairs = pair_block_ids("WRITE", [3, 0, 7], [9, 2, 14], num_local_blocks=8, num_remote_blocks=16)
    assert pairs.local.dtype == np.int32 and pairs.remote.dtype == np.int32
    assert pairs.local.tolist() == [3, 0, 7]
    assert pairs.remote.tolist() == [9, 2, 14]


@pytest.mark.parametrize(("local", "remote", "num_runs"), [
    ([5], [9], 1),
    ([0, 1, 2, 3], [4, 5, 6, 7], 1),
    ([0, 1, 2, 3], [4, 5, 7, 8], 2),  # remote breaks after 5
    ([0, 2, 3, 4], [4, 5, 6, 7], 2),  # local breaks after 0
    ([3, 2, 1, 0], [0, 1, 2, 3], 4),  # descending locally: never contiguous
    ([0, 1, 5, 6, 9], [10, 11, 12, 13, 0], 3),
])
def test_num_runs_counts_pairs_contiguous_on_both_sides(local: list[int], remote: list[int],
                                                        num_runs: int) -> None:
    pairs = pair_block_ids("WRITE", local, remote, num_local_blocks=16, num_remote_blocks=16)
    assert pairs.num_runs == num_runs


@pytest.mark.parametrize(("op", "local", "remote", "param", "message"), [
    ("WRITE", [], [], "local_block_ids", "local_block_ids must be a non-empty list of block ids, got []"),
    ("WRITE", [1, 2], [1], "remote_block_ids", "local_block_ids has 2 ids but remote_block_ids has 1"),
    ("WRITE", [1.0], [1], "local_block_ids", "local_block_ids must hold integers, got dtype float64"),
    ("WRITE", [True], [1], "local_block_ids", "local_block_ids must hold integers, got dtype bool"),
    ("WRITE", [0, 8, -1], [0, 1, 2], "local_block_ids", "local_block_ids [8, -1] out of range [0, 8)"),
    ("WRITE", [0], [16], "remote_block_ids", "remote_block_ids [16] out of range [0, 16)"),
    ("WRITE", [0, 1, 2], [5, 6, 5], "remote_block_ids", "remote_block_ids repeats destination blocks [5]"),
    ("READ", [4, 4], [0, 1], "local_block_ids", "local_block_ids repeats destination blocks [4]"),
])
def test_bad_ids_raise_invalid_request_naming_the_argument(op: str, local: list, remote: list, param: str,
                                                           message: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        pair_block_ids(op, local, remote, num_local_blocks=8, num_remote_blocks=16)
    assert str(raised.value) == message
    assert raised.value.param == param


def test_a_repeated_source_is_allowed() -> None:
    pairs = pair_block_ids("WRITE", [2, 2], [0, 1], num_local_blocks=8, num_remote_blocks=16)
    assert pairs.local.tolist() == [2, 2]


def test_layer_runs_split_each_pairs_layers_at_their_gaps() -> None:
    pairs = pair_block_ids("WRITE", [3, 0, 7], [9, 2, 14], num_local_blocks=8, num_remote_blocks=16,
                           layers=[[1, 2, 4], [0], [0, 1, 2, 3, 4, 5]], num_layers=6)
    assert pairs.layer_runs().tolist() == [[3, 9, 1, 2], [3, 9, 4, 1], [0, 2, 0, 1], [7, 14, 0, 6]]
    assert pair_block_ids("WRITE", [1], [1], 8, 8).layers is None


@pytest.mark.parametrize(("layers", "message"), [
    ([[0], [1]], "layers has 2 entries for 1 block pairs"),
    ([[]], "layers []: must be ascending layer ids in [0, 4), at least one"),
    ([[4]], "layers [4]: must be ascending layer ids in [0, 4), at least one"),
    ([[-1, 2]], "layers [-1, 2]: must be ascending layer ids in [0, 4), at least one"),
    ([[2, 1]], "layers [2, 1]: must be ascending layer ids in [0, 4), at least one"),
    ([[1, 1]], "layers [1, 1]: must be ascending layer ids in [0, 4), at least one"),
    ([[True]], "layers [True]: must be ascending layer ids in [0, 4), at least one"),
])
def test_bad_layers_raise_invalid_request(layers: list, message: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        pair_block_ids("WRITE", [0], [1], 8, 8, layers=layers, num_layers=4)
    assert (str(raised.value), raised.value.param) == (message, "layers")
