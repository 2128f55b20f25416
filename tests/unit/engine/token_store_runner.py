"""A model stand-in for scheduler tests: its "KV cache" stores token ids in the block slots.

The next token is a hash of every token read back through the block table, so a wrong block
table, a wrongly reused block or a lost chunk changes the output. Reference outputs come from
the same function on the plain token list.
"""
from dataclasses import dataclass

import torch

from pdserve.engine.model.batch import ForwardBatch, ForwardOutput

VOCAB = 97


def next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % VOCAB


@dataclass
class _Config:
    vocab_size: int = VOCAB


class TokenStoreRunner:
    device = "cpu"
    lora = None  # serves no LoRA adapters

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        self.config = _Config()
        self.tpb = tokens_per_block
        self.store = torch.full((num_blocks, tokens_per_block), -1, dtype=torch.long)
        self.num_forward_tokens = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        logits = []
        for chunk in batch.chunks:
            for i, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                self.store[chunk.block_table[pos // self.tpb], pos % self.tpb] = token
            self.num_forward_tokens += len(chunk.token_ids)
            end = chunk.start_pos + len(chunk.token_ids)
            context = [int(self.store[chunk.block_table[p // self.tpb], p % self.tpb]) for p in range(end)]
            row = torch.full((VOCAB,), -10.0)
            row[next_token(context)] = 10.0
            logits.append(row[None] if chunk.needs_logits else row[:0][None][:0])
        return ForwardOutput(logits)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.store[dst] = self.store[src]


class CharTokenizer:
    """Token t decodes to chr(65 + t % 26); ids 0 and 1 are EOS."""

    eos_token_ids = (0,)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + t % 26) for t in ids if not (skip_special_tokens and t in self.eos_token_ids))


def reference(prompt: list[int], max_tokens: int, eos: int | None = 0) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == eos:
            break
    return out
