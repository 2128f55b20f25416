"""The routing cost of sending one request to one worker, in KV blocks.

    credit          = device_credit·overlap_device + host_credit·overlap_host + disk_credit·overlap_disk
    new_blocks      = max(prompt_blocks − credit, 0)           blocks the worker must compute or receive
    prefill cost    = prefill_load_scale · (queued_prefill_tokens / tokens_per_block + new_blocks)
                      + active_blocks
    decode cost     = active_blocks + new_blocks                (its prompt is prefilled elsewhere)

Unlike Dynamo's KV router, the credit only offsets this request's own blocks: a worker's
cached prefix never makes the prefill work already queued on it disappear. Loads count what
the worker last reported plus what this router dispatched to it since (see `WorkerPool.load`).
A lower cost is better.
"""
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.errors import ConfigError
from pdserve.router.routing.prefix_index import Overlap


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Credit per block held in each tier (1.0: as good as computing nothing) and the weight
    of prefill work against blocks held by running requests."""

    prefill_load_scale: float = 1.0
    device_credit: float = 1.0
    host_credit: float = 0.75
    disk_credit: float = 0.25

    def __post_init__(self) -> None:
        if self.prefill_load_scale < 0:
            raise ConfigError("prefill_load_scale", self.prefill_load_scale, "must be >= 0")
        for name in ("device_credit", "host_credit", "disk_credit"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(name, value, "must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    num_requests: int  # running + waiting
    num_active_blocks: int  # KV blocks held by those requests
    num_prefill_tokens: int  # prompt tokens still to prefill


def num_prompt_blocks(num_prompt_tokens: int, tokens_per_block: int) -> int:
    """Blocks a prompt occupies, the last one possibly partial."""
    return math.ceil(num_prompt_tokens / tokens_per_block)


def credit(overlap: Overlap, weights: CostWeights) -> float:
    return credits([overlap], weights)[0]


def new_blocks(prompt_blocks: int, overlap: Overlap, weights: CostWeights) -> float:
    """Blocks of the prompt the worker would compute (or receive), after credit for what it holds."""
    return new_blocks_each(prompt_blocks, [overlap], weights)[0]


def prefill_cost(prompt_blocks: int, overlap: Overlap, load: WorkerLoad, tokens_per_block: int,
                 weights: CostWeights) -> float:
    """Cost on a worker that prefills the prompt itself (a prefill worker, or an aggregated one)."""
    return prefill_costs(prompt_blocks, [overlap], [load], tokens_per_block, weights)[0]


def decode_cost(prompt_blocks: int, overlap: Overlap, load: WorkerLoad, weights: CostWeights) -> float:
    """Cost on a decode worker whose prompt a prefill worker computes: the blocks it holds are
    reused locally; the rest it allocates and receives."""
    return decode_costs(prompt_blocks, [overlap], [load], weights)[0]


# The formulas, over every worker of a role at once: the planner prices a role in one call per
# decision, with no Python call per worker (at 64 workers those calls cost more than the index).

def credits(overlaps: Sequence[Overlap], weights: CostWeights) -> list[float]:
    device, host, disk = weights.device_credit, weights.host_credit, weights.disk_credit
    return [device * o.num_device + host * o.num_host + disk * o.num_disk for o in overlaps]


def new_blocks_each(prompt_blocks: int, overlaps: Sequence[Overlap], weights: CostWeights) -> list[float]:
    return [new if new > 0.0 else 0.0 for new in (prompt_blocks - c for c in credits(overlaps, weights))]


def prefill_costs(prompt_blocks: int, overlaps: Sequence[Overlap], loads: Sequence[WorkerLoad],
                  tokens_per_block: int, weights: CostWeights) -> list[float]:
    scale = weights.prefill_load_scale
    return [scale * (load.num_prefill_tokens / tokens_per_block + new) + load.num_active_blocks
            for new, load in zip(new_blocks_each(prompt_blocks, overlaps, weights), loads, strict=True)]


def decode_costs(prompt_blocks: int, overlaps: Sequence[Overlap], loads: Sequence[WorkerLoad],
                 weights: CostWeights) -> list[float]:
    return [load.num_active_blocks + new
            for new, load in zip(new_blocks_each(prompt_blocks, overlaps, weights), loads, strict=True)]
