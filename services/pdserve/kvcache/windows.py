"""Sliding-window layers, and what they let a prompt's KV hand-off leave behind (as TensorRT-LLM's
variable sliding-window attention does for transfer).

A layer of window `w` attends, at query position `p`, only keys at positions `> p - w`. A worker
that receives a prompt of `prompt_len` tokens computes positions `prompt_len` on (the first is
the token its peer sampled), so prompt block `b`, positions `b*tpb .. (b+1)*tpb - 1`, is out of
reach of every query it will compute on a layer of window `w` when `(b+1)*tpb - 1 <= prompt_len
- w`. That layer's slice of the block need not travel: a block out of every window layer's reach
travels with its global layers' slices only, and not at all when every layer has a window.

    # prompt blocks | out of reach of window w: no w-layer slices | within reach: whole | prompt_len ->

The receiver then holds blocks that lack some layers' slices. Each records the first query
position that attends none of them (`SkippedSlices.readable_from`, on `KvBlock`), and a prefix
hit is cut short where a query it leaves to compute would read one (`num_reusable`).
"""
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SkippedSlices:
    """A prompt block handed off without the slices of some window layers."""

    block_index: int  # in the prompt
    layers: tuple[int, ...]  # the layers whose K and V stay behind, ascending
    readable_from: int  # the first query position that attends none of them


class SlidingWindows:
    """Each decoder layer's sliding window (None: a global layer, attending every key)."""

    __slots__ = ("windows", "tokens_per_block", "_layers_by_window")

    def __init__(self, windows: Sequence[int | None], tokens_per_block: int) -> None:
        for window in windows:
            if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise ConfigError("layer_windows", tuple(windows), "each must be a positive integer or None")
        if tokens_per_block < 1:
            raise ConfigError("tokens_per_block", tokens_per_block, "must be positive")
        self.windows = tuple(windows)
        self.tokens_per_block = tokens_per_block
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(self.windows):
            if window is not None:
                by_window.setdefault(window, []).append(layer)
        self._layers_by_window = sorted((w, tuple(layers)) for w, layers in by_window.items())

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    def skipped(self, prompt_len: int, first_block: int, num_blocks: int) -> tuple[SkippedSlices, ...]:
        """The blocks of a hand-off of prompt blocks `[first_block, first_block + num_blocks)`
        that some window layer cannot reach from query `prompt_len` on, each with those layers
        (in block order; a later block is nearer the queries, so it skips no more than one before)."""
        tpb, found = self.tokens_per_block, []
        for index in range(first_block, first_block + num_blocks):
            last = (index + 1) * tpb - 1
            reachless = [(w, layers) for w, layers in self._layers_by_window if last <= prompt_len - w]
            if not reachless:
                break
            layers = tuple(sorted(layer for _, group in reachless for layer in group))
            found.append(SkippedSlices(index, layers, last + reachless[-1][0]))
        return tuple(found)


def num_reusable(readable_from: Sequence[int | None], num_after: int, tokens_per_block: int) -> int:
    """How many blocks of a prefix hit may be reused: device blocks with their `readable_from`
    (None: whole), then `num_after` whole blocks (from a lower tier). Reusing `n` leaves the
    queries from position `n * tokens_per_block` on to compute, so every block `j < n` lacking
    slices needs `readable_from <= n * tokens_per_block`; the most such `n`."""
    total = len(readable_from) + num_after
    if all(r is None for r in readable_from):
        return total
    worst = [0]  # worst[n]: the highest readable_from among the first n device blocks
    for r in readable_from:
        worst.append(worst[-1] if r is None else max(worst[-1], r))
    return next(n for n in range(total, -1, -1) if worst[min(n, len(readable_from))] <= n * tokens_per_block)
