"""vLLM's logits processors that can change the greedy token, applied to a step's batch at once.

In vLLM's order (v1 `Sampler.apply_logits_processors`), on float32 logits, before temperature,
top-k / top-p and the greedy argmax:

1. `bad_words`: a banned token sequence's last token is set to -inf when the tokens generated so
   far end with the rest of the sequence (a one-token sequence is always banned);
2. `min_tokens`: until that many tokens are generated, EOS and `stop_token_ids` are -inf;
3. `logit_bias`: added to the named tokens' logits;
4. penalties: `repetition_penalty` divides the positive logits and multiplies the others of every
   token seen in the prompt or the output; then `frequency_penalty` × (times generated) and
   `presence_penalty` × (generated at all) are subtracted — output tokens only, as OpenAI defines them.
   Unlike vLLM, a penalised logit stays finite: a tiny penalty makes it float32's largest, not
   inf, so a sampled row never gets NaN probabilities (which would draw a token the guide forbids).

Each step is a handful of tensor ops over the rows that ask for it: the per-row Python work is
over a row's own short lists (its bias entries, stop ids, bad words, its token ids), never over
the vocabulary. The penalties touch only the (row, token) cells a row's tokens name, their
counts rebuilt from the sequence's tokens every step (one `unique`), so preemption, recompute
and forks need no bookkeeping here.
"""
import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import SamplingParams

MAX_PENALTY = 2.0  # presence / frequency, as OpenAI and vLLM bound them
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024  # vLLM's bound: a step rebuilds each row's biases, so a row's count is capped


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """A sequence's token ids so far, prompt first: what penalties, min_tokens and bad_words read."""

    token_ids: Sequence[int]
    num_prompt_tokens: int

    @property
    def prompt(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


NO_HISTORY = TokenHistory((), 0)


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def needs_processing(params: SamplingParams) -> bool:
    """Whether any processor here changes this row's logits (most rows: none, and no cost)."""
    return bool(has_penalties(params) or params.logit_bias or params.min_tokens or params.bad_words)


def check_processor_params(params: SamplingParams, vocab_size: int) -> None:
    """InvalidRequestError naming the first processor parameter that cannot be honoured."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequestError(f"{name}={value!r} must be in [-2, 2]", name)
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise InvalidRequestError(f"repetition_penalty={params.repetition_penalty!r} must be finite and > 0",
                                  "repetition_penalty")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise InvalidRequestError(f"min_tokens={params.min_tokens} must be in 0..max_tokens ({params.max_tokens})",
                                  "min_tokens")
    token_ids = [t for t, _ in params.logit_bias]
    if len(token_ids) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(f"logit_bias names {len(token_ids)} tokens; at most {MAX_LOGIT_BIAS_TOKENS}",
                                  "logit_bias")
    if len(set(token_ids)) != len(token_ids):
        raise InvalidRequestError("logit_bias names a token id twice", "logit_bias")
    for token_id, bias in params.logit_bias:
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidRequestError(f"logit_bias of token {token_id} is {bias!r}, outside [-100, 100]", "logit_bias")
    _check_ids(token_ids, vocab_size, "logit_bias")
    for word in params.bad_words:
        if not word:
            raise InvalidRequestError("a bad_words entry has no tokens", "bad_words")
        _check_ids(word, vocab_size, "bad_words")


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, TokenHistory]],
                            eos_token_ids: Collection[int]) -> torch.Tensor:
    """(B, V) float32 logits → the logits each row samples from; `logits` itself (unchanged)
    when no row asks for a processor, else a new tensor."""
    if not any(needs_processing(params) for params, _ in rows):
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)  # penalties index it flat
    _set_cells(logits, _bad_word_cells(rows), float("-inf"))
    _set_cells(logits, _held_stop_cells(rows, eos_token_ids), float("-inf"))
    _add_logit_bias(logits, rows)
    _apply_penalties(logits, rows)
    return logits


def _check_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{param} names token ids {bad[:8]} outside the vocabulary [0, {vocab_size})", param)


Cells = tuple[list[int], list[int]]  # (row indices, token ids)


def _set_cells(logits: torch.Tensor, cells: Cells, value: float) -> None:
    rows, token_ids = cells
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device)] = value


def _bad_word_cells(rows: Sequence[tuple[SamplingParams, TokenHistory]]) -> Cells:
    """The last token of every bad word whose other tokens end the row's output (vLLM: output
    tokens only, so a prompt never completes a bad word's prefix)."""
    cells: Cells = ([], [])
    for i, (params, history) in enumerate(rows):
        if not params.bad_words:
            continue
        tokens = history.token_ids
        for word in params.bad_words:
            prefix = len(word) - 1
            if prefix <= history.num_output_tokens and tuple(tokens[len(tokens) - prefix:]) == word[:prefix]:
                cells[0].append(i)
                cells[1].append(word[-1])
    return cells


def _held_stop_cells(rows: Sequence[tuple[SamplingParams, TokenHistory]], eos_token_ids: Collection[int]) -> Cells:
    """EOS (even with ignore_eos, as vLLM) and stop token ids of rows short of their min_tokens."""
    cells: Cells = ([], [])
    for i, (params, history) in enumerate(rows):
        if history.num_output_tokens < params.min_tokens:
            stops = set(params.stop_token_ids) | set(eos_token_ids)
            cells[0].extend([i] * len(stops))
            cells[1].extend(stops)
    return cells


def _add_logit_bias(logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, TokenHistory]]) -> None:
    entries = [(i, t, b) for i, (params, _) in enumerate(rows) for t, b in params.logit_bias]
    if not entries:
        return
    device = logits.device
    row_ids, token_ids, biases = zip(*entries)
    logits[torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)] += torch.tensor(
        biases, dtype=logits.dtype, device=device)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, TokenHistory]]) -> None:
    """vLLM's `apply_penalties`, in place, on only the cells it can change: a token absent from
    a row's output and prompt keeps its logit exactly (x / 1, x - 0), so the work is over the
    rows' token ids, never over rows × vocabulary."""
    chosen = [i for i, (params, _) in enumerate(rows) if has_penalties(params)]
    if not chosen:
        return
    device, vocab = logits.device, logits.shape[1]
    flat = logits.view(-1)  # (B * V,): cell (row, token) at row * V + token
    penalties = torch.tensor([[rows[i][0].repetition_penalty, rows[i][0].frequency_penalty,
                               rows[i][0].presence_penalty] for i in range(len(rows))],
                             dtype=torch.float32, device=device)  # (B, 3)
    output_cells, counts = torch.unique(_cells([(i, rows[i][1].output) for i in chosen], vocab, device),
                                        return_counts=True)  # (N,), (N,)
    repeated = [(i, rows[i][1].prompt) for i in chosen if rows[i][0].repetition_penalty != 1.0]
    seen = torch.cat([output_cells, _cells(repeated, vocab, device)])  # (S,), a cell twice gets one value twice
    values = flat[seen]
    repetition = penalties[seen // vocab, 0]
    largest = torch.finfo(logits.dtype).max  # a penalty near 0 (5e-324 is 0 in float32) must not make +inf
    flat[seen] = torch.where(values > 0, values / repetition, values * repetition).clamp_(max=largest)
    values = flat[output_cells] - penalties[output_cells // vocab, 1] * counts.to(torch.float32)
    flat[output_cells] = values - penalties[output_cells // vocab, 2]  # vLLM subtracts the two in turn


def _cells(token_lists: Sequence[tuple[int, Sequence[int]]], vocab: int, device: torch.device) -> torch.Tensor:
    """(total tokens,) int64: row * vocab + token for every (row, its tokens) pair."""
    lengths = [len(tokens) for _, tokens in token_lists]
    row_ids = np.repeat(np.array([row for row, _ in token_lists], dtype=np.int64), lengths)
    tokens = np.fromiter(itertools.chain.from_iterable(t for _, t in token_lists), np.int64, sum(lengths))
    return torch.from_numpy(row_ids * vocab + tokens).to(device)  # numpy reads int lists ~3x faster than torch
