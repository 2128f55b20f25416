"""What the scheduler hands the model runner for one step, and what comes back.

A step computes a chunk of new tokens for each scheduled sequence. Positions are
absolute: token i of a chunk sits at position `start_pos + i`, its KV goes to
`block_table[pos // tokens_per_block]`, slot `pos % tokens_per_block`.

    # | start_pos tokens already in KV (cached or computed) | chunk tokens |
"""
from dataclasses import dataclass, field

import torch

from pdserve.common.ids import RequestId


@dataclass(slots=True, frozen=True)
class SeqChunk:
    request_id: RequestId
    token_ids: tuple[int, ...]  # the new tokens computed this step
    start_pos: int  # tokens of this sequence whose KV is already written
    block_table: tuple[int, ...]  # physical block ids covering >= start_pos + len(token_ids)
    needs_logits: bool = True  # logits for the last token (False for a mid-prompt chunk)
    all_logits: bool = False  # logits for every chunk token (teacher-forced checks)
    lora_id: int | None = None  # the LoRA adapter its tokens run under; None: the base model
    is_prompt: bool = False  # it starts within the prompt: computed as a prompt, however few its tokens


@dataclass(slots=True, frozen=True)
class ForwardBatch:
    chunks: tuple[SeqChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(slots=True, frozen=True)
class HiddenCapture:
    """Which of the target's hidden states a step returns for every token (a drafter's ask):
    `final`, the final normed hidden state (what the LM head reads: EAGLE-1, MTP), and `layers`,
    the residual stream entering each of these decoder layers (EAGLE-3's low, mid and high)."""

    final: bool = False
    layers: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.final and not self.layers


@dataclass(slots=True, frozen=True)
class HiddenStates:
    """One step's hidden states, a row per token of the flattened batch (chunk after chunk)."""

    final: torch.Tensor | None  # (T, H) where `HiddenCapture.final`, else None
    layers: torch.Tensor | None  # (T, len(layers) * H): each asked layer's input side by side, else None


@dataclass(slots=True)
class ForwardOutput:
    # logits[i] is (num_positions_i, vocab): 1 row for needs_logits, len(chunk) rows for
    # all_logits, 0 rows otherwise.
    logits: list = field(default_factory=list)
    hidden: HiddenStates | None = None  # only where the runner was asked (`ModelRunner.capture_hidden`)
