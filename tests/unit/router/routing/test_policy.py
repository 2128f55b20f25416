"""Routing policies: lowest cost, tie-breaks, softmax sampling, and the comparison policies."""
import random
from collections import Counter

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.ids import WorkerId
from pdserve.router.routing.policy import Candidate, KvAwarePolicy, make_policy, softmax_weights


def cand(worker: str, cost: float, num_requests: int = 0, num_blocks: int = 0) -> Candidate:
    return Candidate(WorkerId(worker), cost, num_requests, num_blocks)


def choices(policy_name: str, candidates: list[Candidate], n: int, temperature: float = 0.0) -> Counter[str]:
    policy = make_policy(policy_name, temperature, random.Random(7))
    return Counter(policy.choose(candidates).worker for _ in range(n))


def test_kv_aware_takes_the_lowest_cost() -> None:
    assert choices("kv_aware", [cand("a", 5.0), cand("b", 2.5, num_requests=9), cand("c", 3.0)], 20) == {"b": 20}


def test_kv_aware_breaks_a_cost_tie_by_load_then_at_random() -> None:
    assert choices("kv_aware", [cand("a", 2.0, 3), cand("b", 2.0, 1), cand("c", 9.0, 0)], 20) == {"b": 20}
    spread = choices("kv_aware", [cand("a", 2.0, 1), cand("b", 2.0, 1), cand("c", 2.0, 2)], 300)
    assert set(spread) == {"a", "b"}
    assert min(spread.values()) > 100  # both drawn, neither starved


def test_softmax_weights_normalise_costs_by_their_spread() -> None:
    weights = softmax_weights([10.0, 20.0], 1.0)
    assert weights == pytest.approx([1 / (1 + 2.718281828459045 ** -1), 1 - 1 / (1 + 2.718281828459045 ** -1)])
    assert softmax_weights([3.0, 3.0, 3.0], 0.5) == [1 / 3, 1 / 3, 1 / 3]
    assert softmax_weights([0.0, 1.0], 0.1)[1] == pytest.approx(1 / (1 + 2.718281828459045 ** 10))


def test_temperature_samples_every_candidate_with_the_cheapest_most_often() -> None:
    drawn = choices("kv_aware", [cand("a", 0.0), cand("b", 1.0)], 2000, temperature=1.0)
    assert drawn["a"] > drawn["b"] > 0
    assert drawn["a"] / 2000 == pytest.approx(softmax_weights([0.0, 1.0], 1.0)[0], abs=0.05)


def test_round_robin_cycles_in_address_order_whatever_the_cost() -> None:
    policy = make_policy("round_robin", 0.0, random.Random(0))
    candidates = [cand("c", 0.0), cand("a", 9.0), cand("b", 5.0)]
    assert [policy.choose(candidates).worker for _ in range(5)] == ["a", "b", "c", "a", "b"]


def test_least_loaded_takes_fewest_requests_then_fewest_blocks() -> None:
    assert choices("least_loaded", [cand("a", 0.0, 2, 1), cand("b", 9.0, 1, 50), cand("c", 9.0, 1, 40)], 10) == {
        "c": 10}


def test_random_draws_every_candidate() -> None:
    assert set(choices("random", [cand("a", 0.0), cand("b", 100.0)], 200)) == {"a", "b"}


def test_unknown_policy_and_negative_temperature_are_refused() -> None:
    with pytest.raises(ConfigError, match="routing_policy='fastest': must be one of kv_aware, round_robin"):
        make_policy("fastest", 0.0, random.Random(0))
    with pytest.raises(ConfigError, match="router_temperature=-1.0"):
        KvAwarePolicy(-1.0, random.Random(0))
