"""What drafts tokens: the `Proposer` protocol, and `build_proposer` from the settings.

A drafter that keeps K/V of its own (a draft model, an EAGLE head, MTP layers) keeps it in a
KV tensor of its own indexed by the target's block ids: the KV cache manager's blocks, block
tables, prefix matches and frees govern both, so each of the manager's blocks costs the target's
bytes plus `drafter_bytes_per_block` (the worker sizes its cache with both).
"""
import importlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.spec.ngram import NgramProposer

# method → the module that serves it; each has `load(config, context) -> Proposer` and
# `kv_bytes_per_block(config, tokens_per_block, kv_dtype) -> int`.
MODEL_DRAFTERS = {"draft_model": "pdserve.engine.spec.draft_model", "eagle": "pdserve.engine.spec.eagle",
                  "eagle3": "pdserve.engine.spec.eagle", "mtp": "pdserve.engine.spec.mtp"}


class Proposer(Protocol):
    def propose(self, seqs: Seq, num_tokens: Seq[int]) -> list[list[int]]:
        """Drafts for each running decode sequence (`engine.core.sequence.Sequence`), at most
        `num_tokens[i]` for `seqs[i]`; an empty list drafts nothing for it."""

    def observe(self, batch, output) -> None:
        """The target's step (`ForwardBatch`, `ForwardOutput`), before its tokens are sampled."""


@dataclass(frozen=True, slots=True)
class DrafterContext:
    """What a model drafter is built against: the target's runner (its block ids are the KV
    manager's), the manager, and the worker's settings for loading a checkpoint."""

    target: object  # ModelRunner
    kv: object  # KvCacheManager
    dtype: str = "auto"
    kernels: str = "auto"
    cache_dir: str | None = None
    max_model_len: int | None = None  # positions a drafter must read; None: the target's context length


class NgramDrafts:
    """n-gram lookup over each sequence's own tokens (`ngram.py`)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.lookup = NgramProposer(min_n, max_n)

    def propose(self, seqs: Seq, num_tokens: Seq[int]) -> list[list[int]]:
        return [self.lookup.propose(seq.token_ids, n) for seq, n in zip(seqs, num_tokens)]

    def observe(self, batch, output) -> None:
        pass


def build_proposer(config: SpeculativeConfig, context: DrafterContext) -> Proposer:
    """The drafter `config` names (ConfigError where its checkpoint cannot serve)."""
    if config.method == "ngram":
        return NgramDrafts(config.prompt_lookup_min, config.prompt_lookup_max)
    return importlib.import_module(MODEL_DRAFTERS[config.method]).load(config, context)


def drafter_bytes_per_block(config: SpeculativeConfig | None, tokens_per_block: int, kv_dtype: torch.dtype) -> int:
    """Bytes of the drafter's own K/V for one of the manager's blocks (0 for n-gram lookup)."""
    if config is None or config.method == "ngram":
        return 0
    return importlib.import_module(MODEL_DRAFTERS[config.method]).kv_bytes_per_block(config, tokens_per_block, kv_dtype)
