"""What drafts tokens: the `Proposer` protocol, and `build_proposer` from the settings."""
from collections.abc import Sequence as Seq
from typing import Protocol

from pdserve.common.errors import ConfigError
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.spec.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seqs: Seq, num_tokens: Seq[int]) -> list[list[int]]:
        """Drafts for each running decode sequence (`engine.core.sequence.Sequence`), at most
        `num_tokens[i]` for `seqs[i]`; an empty list drafts nothing for it."""


class NgramDrafts:
    """n-gram lookup over each sequence's own tokens (`ngram.py`)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.lookup = NgramProposer(min_n, max_n)

    def propose(self, seqs: Seq, num_tokens: Seq[int]) -> list[list[int]]:
        return [self.lookup.propose(seq.token_ids, n) for seq, n in zip(seqs, num_tokens)]


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The drafter `config` names; ConfigError for one this build cannot run."""
    if config.method == "ngram":
        return NgramDrafts(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ConfigError("speculative_config.method", config.method, "not served yet; use ngram")
