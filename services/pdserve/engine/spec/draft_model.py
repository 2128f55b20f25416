"""Draft-model speculation: a small model of the target's vocabulary drafts k tokens greedily.

    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}

The draft runs in the target's worker on the target's device, dtype, kernels and cache folder,
with a KV tensor of its own shaped like the target's blocks: the KV cache manager's block b holds
the target's K/V at block b of the target's tensor and the draft's at block b of the draft's. The
draft reads and writes through the target's block tables, so the manager's claims, frees and
preemptions govern both (each block costs both models' bytes: `kv_bytes_per_block`).

One `propose` call drafts for every sequence at once, each of its forwards batched over them:

    positions  | draft K/V written and valid | catch-up, through the last token | d1 … d(k-1) |
    forwards   |                             | one chunk (several when long)    | one each    |

The catch-up's last row gives d1; each drafted token fed gives the next. Drafts are the argmax
of the draft's logits, a one-point proposal whose acceptance the engine's verification decides:
the drafts never change the output, only how many tokens a step gains.

Which draft K/V is valid: a sequence's state lists the tokens fed from position 0 and the block
table they were written through. The next call keeps the common prefix of those tokens with the
sequence's own (its accepted drafts, then the target's token) that lies in blocks still at the
same place of its table, and feeds the rest again. That holds through preemptions: the draft's
tensor is written only in `propose`, through the current block tables of the sequences drafted
for, and a call first forgets the sequences it does not draft for (a preempted one is waiting or
prefilling). So between two calls that keep a sequence nothing writes its draft K/V, and within
a call another sequence writes into one of its blocks only where they share it: the same tokens,
so the same values. `observe` forgets the sequences the manager no longer holds, so there are
never more states than sequences.

Why computing a sequence's K/V from position 0 the first time is safe, though its prompt's
blocks may be shared (prefix-cache hits, forks) or hold only the target's K/V (the host tier,
the disk tier and a prefill peer move the target's tensor alone): K/V at a position depends only
on the tokens up to it, so the draft writes into a shared block exactly what any other holder's
draft writes there, and it writes past the target's computed tokens only into blocks the
sequence holds alone (a block is shared once full and computed). The cost is one draft pass
over each prompt, even one the target found cached or received from a peer (on a decode worker,
every prompt), in the step that first drafts for it. Measured on tiny random models (a 2-layer
target, a 1-layer draft, a 49,152-token vocabulary; native kernels, one thread; k=4): that step
took 16 ms after a 512-token prompt and 47 ms after 2,048 tokens, against 10 and 14 ms for the
steps after it: the draft's prompt pass, about half the target's own prefill of that prompt
(66 ms at 2,048), here where the draft has half the target's layers.

A sequence under a LoRA adapter is drafted without it: drafts only need to be likely, and the
target, adapter included, verifies them.
"""
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from pdserve.common.errors import ConfigError, OutOfBlocksError
from pdserve.common.ids import BlockId, RequestId
from pdserve.common.speculative import FIELD, SpeculativeConfig
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.loading.weights import DTYPES, load_model_config
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.model.kv_tensor import FP8_DTYPE, bytes_per_block
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.spec.proposers import DrafterContext
from pdserve.kvcache import KvCacheManager

MODEL_FIELD = f"{FIELD}.model"
# Tokens of one catch-up forward: a long prompt is fed in pieces, bounding the step's activations.
MAX_CATCH_UP_TOKENS = 2048


def kv_bytes_per_block(config: SpeculativeConfig, tokens_per_block: int, kv_dtype: torch.dtype) -> int:
    """The draft's K/V bytes for one of the manager's blocks, stored as the target's (`kv_dtype`)."""
    return bytes_per_block(_draft_config(config.model), tokens_per_block, kv_dtype)


def load(config: SpeculativeConfig, context: DrafterContext) -> "DraftModelProposer":
    """The draft checkpoint loaded beside the target; ConfigError naming `speculative_config.model`
    for a vocabulary other than the target's or a context shorter than `max_model_len`."""
    target = context.target
    draft = _draft_config(config.model)
    if draft.vocab_size != target.config.vocab_size:
        raise ConfigError(MODEL_FIELD, config.model, f"its vocabulary has {draft.vocab_size} tokens, the target's "
                          f"{target.config.vocab_size}: a draft model must share the target's tokenizer")
    max_model_len = context.max_model_len or target.config.max_position_embeddings
    if draft.max_position_embeddings < max_model_len:
        raise ConfigError(MODEL_FIELD, config.model, f"it reads at most {draft.max_position_embeddings} positions, "
                          f"fewer than max_model_len ({max_model_len})")
    kv_cache_dtype = "fp8" if target.kv_tensor.dtype == FP8_DTYPE else "auto"
    dtype = next(name for name, value in DTYPES.items() if value == target.dtype)  # its K/V stored as the target's
    try:
        runner = ModelRunner.load(config.model, dtype, target.device, num_blocks=target.num_blocks,
                                  tokens_per_block=target.tokens_per_block, kv_cache_dtype=kv_cache_dtype,
                                  kv_scale=target.kv.scale, cache_dir=context.cache_dir, kernels=context.kernels)
    except ConfigError as err:
        raise ConfigError(MODEL_FIELD, config.model, f"{err.field}: {err.reason}") from None
    return DraftModelProposer(runner, context.kv)


def _draft_config(path: str) -> ModelConfig:
    try:
        return load_model_config(path)
    except ConfigError as err:
        raise ConfigError(MODEL_FIELD, path, err.reason) from None


@dataclass(slots=True)
class DraftKv:
    """What the draft's K/V holds for one sequence: `fed[i]`'s K/V at position i, written
    through `block_ids` (the sequence's block table then)."""

    seq: Sequence  # the sequence itself: a request id used again is another sequence
    fed: list[int] = field(default_factory=list)
    block_ids: tuple[BlockId, ...] = ()

    def num_valid(self, block_ids: tuple[BlockId, ...], tokens_per_block: int) -> int:
        """Positions whose draft K/V is right: fed tokens agreeing with the sequence's, in
        blocks it still holds."""
        return min(_common_prefix(self.fed, self.seq.token_ids),
                   _common_prefix(self.block_ids, block_ids) * tokens_per_block)


@dataclass(slots=True)
class Plan:
    """One sequence's part of a `propose` call."""

    state: DraftKv
    num_drafts: int
    block_ids: tuple[BlockId, ...]
    drafts: list[int] = field(default_factory=list)

    def chunk(self, token_ids: Seq[int]) -> SeqChunk:
        """The next forward's chunk feeding `token_ids` after the fed ones; logits for its last
        token when that is the sequence's last or a draft."""
        seq, start = self.state.seq, len(self.state.fed)
        return SeqChunk(seq.seq_id, tuple(token_ids), start, self.block_ids,
                        needs_logits=start + len(token_ids) >= len(seq.token_ids),
                        is_prompt=start < seq.num_prompt_tokens)


class DraftModelProposer:
    """Drafts with the draft model's greedy continuation (see the module docstring)."""

    def __init__(self, runner: ModelRunner, kv: KvCacheManager) -> None:
        self.runner = runner
        self.kv = kv  # the target's KvCacheManager: block tables and slot reservations
        self._states: dict[RequestId, DraftKv] = {}

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[list[int]]:
        self._forget_all_but(seqs)
        plans = [self._plan(seq, n) for seq, n in zip(seqs, num_tokens)]
        live = [p for p in plans if p is not None]
        if live:
            self._catch_up(live)
            self._draft_rest(live)
        return [p.drafts if p is not None else [] for p in plans]

    def observe(self, batch: ForwardBatch, output) -> None:
        """Forget the sequences the manager no longer holds (finished, or preempted and waiting)."""
        for seq_id in [s for s in self._states if not self.kv.has_request(s)]:
            del self._states[seq_id]

    def _forget_all_but(self, seqs: Seq[Sequence]) -> None:
        """Keep the states of `seqs` only (before this call writes any draft K/V)."""
        kept = {seq.seq_id: seq for seq in seqs}
        self._states = {seq_id: state for seq_id, state in self._states.items() if kept.get(seq_id) is state.seq}

    def _plan(self, seq: Sequence, num_drafts: int) -> Plan | None:
        """Reserve the slots the drafts and their verification need (None, drafting nothing, when
        the blocks are not free: drafts never preempt anyone) and keep the valid draft K/V."""
        if num_drafts < 1:
            return None
        try:
            self.kv.allocate_slots(seq.seq_id, 1 + num_drafts)
        except OutOfBlocksError:
            return None
        block_ids = tuple(self.kv.block_ids(seq.seq_id))
        state = self._states.setdefault(seq.seq_id, DraftKv(seq))
        # at least the last token is fed: its row gives the first draft
        del state.fed[min(state.num_valid(block_ids, self.kv.tokens_per_block), len(seq.token_ids) - 1):]
        state.block_ids = block_ids
        return Plan(state, num_drafts, block_ids)

    def _catch_up(self, plans: list[Plan]) -> None:
        """Feed each sequence's tokens from its first unwritten position through its last, at most
        MAX_CATCH_UP_TOKENS a forward; each one's last row gives its first draft."""
        waiting = plans
        while waiting:
            budget, fed = MAX_CATCH_UP_TOKENS, []
            for plan in waiting:
                if budget == 0:
                    break
                start = len(plan.state.fed)
                token_ids = plan.state.seq.token_ids[start:start + budget]
                fed.append((plan, plan.chunk(token_ids)))
                budget -= len(token_ids)
            rows = self.runner.forward(ForwardBatch(tuple(c for _, c in fed))).logits
            for (plan, chunk), logits in zip(fed, rows):
                plan.state.fed.extend(chunk.token_ids)
                if chunk.needs_logits:
                    plan.drafts.append(int(logits[-1].argmax()))
            waiting = [p for p in waiting if not p.drafts]

    def _draft_rest(self, plans: list[Plan]) -> None:
        """Feed each draft in turn, one token per sequence a forward, until each has its count."""
        while plans := [p for p in plans if len(p.drafts) < p.num_drafts]:
            batch = ForwardBatch(tuple(p.chunk(p.drafts[-1:]) for p in plans))
            rows = self.runner.forward(batch).logits
            best = torch.cat([logits[-1:] for logits in rows]).argmax(dim=-1).tolist()  # (B,)
            for plan, token in zip(plans, best):
                plan.state.fed.append(plan.drafts[-1])
                plan.drafts.append(token)


def _common_prefix(a: Seq, b: Seq) -> int:
    """Length of the longest common prefix of two lists (or two tuples), by a binary search over
    slice comparisons (C speed: a long prompt costs microseconds)."""
    low, high = 0, min(len(a), len(b)) + 1  # a[:low] == b[:low]; a[:high] != b[:high] or past the end
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low
