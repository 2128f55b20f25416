"""The routing cost, with exact values."""
import pytest

from pdserve.common.errors import ConfigError
from pdserve.router.routing.cost import (
    CostWeights,
    WorkerLoad,
    credit,
    decode_cost,
    decode_costs,
    new_blocks,
    num_prompt_blocks,
    prefill_cost,
    prefill_costs,
)
from pdserve.router.routing.prefix_index import Overlap

W = CostWeights()
IDLE = WorkerLoad(num_requests=0, num_active_blocks=0, num_prefill_tokens=0)


def test_a_partial_last_block_counts_as_a_block() -> None:
    assert [num_prompt_blocks(n, 16) for n in (1, 16, 17, 100)] == [1, 1, 2, 7]


def test_credit_weighs_each_tier() -> None:
    assert credit(Overlap(num_device=4, num_host=2, num_disk=4), W) == 4 + 1.5 + 1.0
    assert credit(Overlap(num_device=4), CostWeights(device_credit=0.5)) == 2.0


def test_new_blocks_never_go_below_zero() -> None:
    assert new_blocks(10, Overlap(num_device=3, num_host=4), W) == 4.0
    assert new_blocks(2, Overlap(num_device=5), W) == 0.0


def test_prefill_cost_adds_queued_prefill_this_prompts_new_blocks_and_held_blocks() -> None:
    load = WorkerLoad(num_requests=3, num_active_blocks=20, num_prefill_tokens=64)
    # queued 64/16 = 4 blocks, new 10 - 6 = 4 blocks, 20 held
    assert prefill_cost(10, Overlap(num_device=6), load, 16, W) == 4 + 4 + 20
    assert prefill_cost(10, Overlap(num_device=6), load, 16, CostWeights(prefill_load_scale=2.0)) == 2 * 8 + 20


def test_a_cached_prefix_does_not_discount_work_already_queued() -> None:
    load = WorkerLoad(num_requests=1, num_active_blocks=0, num_prefill_tokens=160)
    assert prefill_cost(4, Overlap(num_device=8), load, 16, W) == 10.0


def test_decode_cost_is_held_blocks_plus_the_blocks_it_must_receive() -> None:
    load = WorkerLoad(num_requests=5, num_active_blocks=30, num_prefill_tokens=999)
    assert decode_cost(10, Overlap(num_device=2, num_host=4), load, W) == 30 + (10 - 2 - 3)


def test_holding_the_prefix_beats_an_idle_worker_until_the_load_outweighs_it() -> None:
    holder = Overlap(num_device=8)
    assert prefill_cost(10, holder, WorkerLoad(1, 7, 0), 16, W) < prefill_cost(10, Overlap(), IDLE, 16, W)
    assert prefill_cost(10, holder, WorkerLoad(1, 9, 0), 16, W) > prefill_cost(10, Overlap(), IDLE, 16, W)


@pytest.mark.parametrize("field, value", [("host_credit", 1.5), ("disk_credit", -0.1), ("prefill_load_scale", -1)])
def test_bad_weights_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as err:
        CostWeights(**{field: value})
    assert err.value.field == field


def test_a_role_is_priced_at_once_as_each_worker_would_be() -> None:
    overlaps = [Overlap(), Overlap(num_device=6), Overlap(num_host=4, num_disk=4)]
    loads = [IDLE, WorkerLoad(3, 20, 64), WorkerLoad(1, 5, 0)]
    assert prefill_costs(10, overlaps, loads, 16, W) == [10.0, 4 + 4 + 20, 0 + 6 + 5]
    assert decode_costs(10, overlaps, loads, W) == [10.0, 20 + 4, 5 + 6]
