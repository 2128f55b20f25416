"""Speculative decoding in the engine's step: drafts before the forward, verification after.

    forward:  [last token | d1 d2 d3 d4]   one chunk, logits for each of its 5 rows
    verify:   row 0 → x0; x0 == d1 → row 1 → x1; x1 == d2 → … the first disagreement (or the
              last row) ends it: the sequence gains the agreeing drafts and one token of its own

Each row is sampled exactly as a decode step without drafts samples that position: through
`LLMEngine`'s own sampling and emit path, with the logits processors over the tokens so far
(accepted drafts included), the grammar state after them, and for a seeded request the next
draw of its own stream. A draft is accepted when the token sampled at its position equals it.
So greedy output equals the output without speculation token for token, and a seeded sampled
output too. For sampling this is rejection sampling (Leviathan et al., 2023) with a one-point
draft distribution: the draft d is kept with probability p(d), and otherwise the token is
the target's own draw, which is then distributed as p without d, renormalised; every emitted
token follows the target's distribution. Rows are sampled in waves (wave i: row i of every
sequence still agreeing, one sampler call), so a step makes at most k + 1 sampler calls.

KV: the forward writes every draft's K/V, but only an accepted draft is appended to the
sequence's tokens and then marked computed, so the KV cache manager publishes a block (events,
router index, tiers, prefix matches) only once all its tokens are accepted; a rejected draft's
slot lies past the computed tokens and the next step's token overwrites it.
"""
from collections.abc import Callable
from dataclasses import replace

import torch

from pdserve.common.request import RequestOutput
from pdserve.engine.core.request_stats import SpecCounts
from pdserve.engine.core.sequence import Sequence, SeqStatus
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.spec.proposers import Proposer
from pdserve.kvcache import KvCacheManager

Emit = Callable[[list[tuple[Sequence, torch.Tensor]]], list[RequestOutput]]
Verified = tuple[Sequence, tuple[int, ...], torch.Tensor]  # the sequence, its drafts, (1 + drafts, vocab) logits


class Speculator:
    """Drafts tokens for running decodes (`draft`) and verifies them after the forward (`verify`)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, kv: KvCacheManager, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len

    def draft(self, running: list[Sequence], num_waiting: int) -> None:
        """Set `draft_tokens` of every running sequence for this step (() where none)."""
        for seq in running:
            seq.draft_tokens = ()
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) + num_waiting >= limit:
            return
        seqs = [s for s in running if _is_decoding(s)]
        budgets = [self._budget(s) for s in seqs]
        seqs, budgets = [s for s, b in zip(seqs, budgets) if b > 0], [b for b in budgets if b > 0]
        if not seqs:
            return
        for seq, budget, drafts in zip(seqs, budgets, self.proposer.propose(seqs, budgets)):
            seq.draft_tokens = tuple(drafts[:budget])

    def observe(self, batch, output) -> None:
        """The target's step, for a drafter that reads its hidden states or keeps K/V of its own."""
        self.proposer.observe(batch, output)

    def _budget(self, seq: Sequence) -> int:
        """Drafts worth verifying: none past max_tokens (the last emitted token is the target's own)
        or the context limit (the chunk's last draft sits at position len(token_ids) + k - 1)."""
        left = seq.request.sampling.max_tokens - seq.num_output_tokens - 1
        return max(min(self.config.num_speculative_tokens, left, self.max_model_len - len(seq.token_ids)), 0)

    def verify(self, verified: list[Verified], emit: Emit, counts: SpecCounts) -> list[RequestOutput]:
        """Sample each sequence's rows in waves until its first disagreement; one merged output each."""
        merged: dict[Sequence, RequestOutput] = {}
        for _, drafts, _ in verified:
            counts.drafted(len(drafts))
        alive = verified
        position = 0
        while alive:
            outputs = emit([(seq, logits[position]) for seq, _, logits in alive])
            agreeing = []
            for item, output in zip(alive, outputs):
                seq, drafts, _ = item
                merged[seq] = output if seq not in merged else _joined(merged[seq], output)
                if position < len(drafts) and output.finish_reason is None and output.token_ids == (drafts[position],):
                    self.kv.mark_computed(seq.seq_id, 1)  # its K/V was written by this step's forward
                    seq.num_computed_tokens += 1
                    counts.accepted(position)
                    agreeing.append(item)
            alive = agreeing
            position += 1
        return list(merged.values())


class NoSpeculation:
    """One token per sequence per step: drafts nothing, so the engine never verifies."""

    def draft(self, running: list[Sequence], num_waiting: int) -> None:
        pass

    def observe(self, batch, output) -> None:
        pass


NO_SPECULATION = NoSpeculation()


def _is_decoding(seq: Sequence) -> bool:
    """Running with one token to compute, after its prompt (a prefill-only sequence never decodes)."""
    return (seq.status is SeqStatus.RUNNING and not seq.prefill_only and seq.num_output_tokens > 0
            and seq.num_uncomputed == 1)


def _joined(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One step's output for a sequence that gained several tokens."""
    return replace(first, token_ids=first.token_ids + then.token_ids, text=first.text + then.text,
                   logprobs=first.logprobs + then.logprobs, finish_reason=then.finish_reason, error=then.error,
                   error_param=then.error_param)
