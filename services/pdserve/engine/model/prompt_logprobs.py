"""Logprobs of a prompt's own tokens, from the logits its prefill computes (vLLM's
`prompt_logprobs`, behind the completions API's `echo` with `logprobs`).

The logits at prompt position p are the model's distribution for the token at p + 1, so a
chunk's rows give the logprobs of the prompt tokens that follow each of its positions; the
first prompt token has none. Like generated tokens' logprobs they are of the raw logits
(log_softmax before temperature or filters), each with the best `num_top`.
"""
from collections.abc import Sequence

import torch

from pdserve.common.request import TokenLogprob

ROWS_PER_SLICE = 256  # bounds the float32 log_softmax copy of a long chunk's (rows, vocab) logits


def prompt_token_logprobs(logits: torch.Tensor, next_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """One `TokenLogprob` per row of `logits` (rows, vocab): of `next_ids[row]`, with the top `num_top`."""
    if logits.shape[0] != len(next_ids):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(next_ids)} next tokens")
    out: list[TokenLogprob] = []
    for first in range(0, len(next_ids), ROWS_PER_SLICE):
        rows = logits[first:first + ROWS_PER_SLICE].float().log_softmax(dim=-1)  # (S, V)
        ids = list(next_ids[first:first + ROWS_PER_SLICE])
        chosen = rows.gather(1, torch.tensor(ids, device=rows.device)[:, None])[:, 0].tolist()  # (S,)
        top_lp, top_ids = rows.topk(min(num_top, rows.shape[1]), dim=-1)  # (S, N)
        for token_id, logprob, lps, top in zip(ids, chosen, top_lp.tolist(), top_ids.tolist()):
            out.append(TokenLogprob(token_id, logprob, tuple(zip(top, lps))))
    return out
