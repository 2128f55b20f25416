"""Routing policies: how one worker is chosen among scored candidates.

Every policy sees the same candidates (cost from `cost.py`, load in requests); only
`kv_aware` looks at the cost. The others exist to compare against.
- `kv_aware`: lowest cost; ties broken by fewer requests, then at random. With a temperature
  T > 0, a softmax draw instead: p(w) ∝ exp(−(cost_w − min) / (max − min) / T).
- `round_robin`: the next candidate in address order, one counter per policy instance.
- `least_loaded`: fewest requests, then fewest active blocks; ties at random.
- `random`: uniform.
"""
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from pdserve.common.errors import ConfigError
from pdserve.common.ids import WorkerId
from pdserve.common.settings import ROUTING_POLICIES


@dataclass(slots=True)
class Candidate:
    """One worker as a policy sees it. Not frozen: the planner builds one per worker per decision,
    and a frozen dataclass takes several times as long to build (benchmarks/router_scale.py)."""

    worker: WorkerId
    cost: float
    num_requests: int
    num_active_blocks: int


class Policy(Protocol):
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        """One of `candidates` (never empty)."""
        ...


def _lowest(candidates: Sequence[Candidate], key: Callable[[Candidate], tuple], rng: random.Random) -> Candidate:
    keys = list(map(key, candidates))
    best = min(keys)
    return rng.choice([c for c, k in zip(candidates, keys) if k == best])


_BY_COST = attrgetter("cost", "num_requests")
_BY_LOAD = attrgetter("num_requests", "num_active_blocks")


class KvAwarePolicy:
    def __init__(self, temperature: float, rng: random.Random) -> None:
        if temperature < 0 or not math.isfinite(temperature):
            raise ConfigError("router_temperature", temperature, "must be a finite number >= 0")
        self._temperature = temperature
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        if self._temperature == 0.0 or len(candidates) == 1:
            return _lowest(candidates, _BY_COST, self._rng)
        weights = softmax_weights([c.cost for c in candidates], self._temperature)
        return self._rng.choices(list(candidates), weights=weights)[0]


def softmax_weights(costs: Sequence[float], temperature: float) -> list[float]:
    """Probabilities over `costs` (lower is likelier), costs normalised to [0, 1] first."""
    low, high = min(costs), max(costs)
    spread = high - low
    if spread == 0.0:
        return [1.0 / len(costs)] * len(costs)
    logits = [-(c - low) / spread / temperature for c in costs]
    exps = [math.exp(x) for x in logits]  # every logit <= 0: no overflow
    total = sum(exps)
    return [e / total for e in exps]


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._num_chosen = 0

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.worker)
        chosen = ordered[self._num_chosen % len(ordered)]
        self._num_chosen += 1
        return chosen


class LeastLoadedPolicy:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return _lowest(candidates, _BY_LOAD, self._rng)


class RandomPolicy:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return self._rng.choice(list(candidates))


def make_policy(name: str, temperature: float, rng: random.Random) -> Policy:
    """A fresh policy instance (a router keeps one per role, so round robin cycles each)."""
    if name == "kv_aware":
        return KvAwarePolicy(temperature, rng)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy(rng)
    if name == "random":
        return RandomPolicy(rng)
    raise ConfigError("routing_policy", name, f"must be one of {', '.join(ROUTING_POLICIES)}")
