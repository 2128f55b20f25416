"""Next-token choice for one step's batch of logits rows.

First vLLM's logits processors that can change the greedy token (bad words, min_tokens,
logit_bias, repetition / frequency / presence penalties; `logits_processors.py`) adjust the
rows that ask for them. Then greedy rows (temperature 0) take the argmax. Other rows are
scaled by temperature, filtered by top-k then top-p (on the renormalised top-k mass), and
sampled by the exponential race: argmax(p / q) with q ~ Exp(1) per token, which picks token i
with probability p_i. A seeded sequence draws its q from its own generator, exactly one
(vocab,) vector per sampled step, so its tokens depend only on its seed, its own logits and
its own tokens so far, never on which other rows share the batch. Unseeded rows share the sampler's
generator.

Logprobs, when asked for, are of the model's own distribution (log_softmax of the raw
logits, before processors, temperature and filters), as vLLM (its default `logprobs_mode`,
`raw_logprobs`) and OpenAI report them.

A guided row (structured output) has every token its grammar forbids set to -inf after the
logits processors, all guided rows in one bitmask (`guided.py`); choice and sampling then see
only what the grammar allows.
"""
import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import SamplingParams, TokenLogprob
from pdserve.engine.model.guided import GuideMasks, GuideMatcher
from pdserve.engine.model.logits_processors import (NO_HISTORY, TokenHistory, apply_logits_processors,
                                                    check_processor_params)

MAX_LOGPROBS = 20  # top-N per token, as the router's API (and vLLM's default); more grows each output by the vocab


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One logits row's parameters, for a seeded sequence its random stream, and the sequence's
    tokens so far (read only by the logits processors its params ask for)."""

    params: SamplingParams
    generator: torch.Generator | None = None  # from make_generator(seed, index); None: shared
    guide: GuideMatcher | None = None  # the sequence's grammar state, when its output is guided
    history: TokenHistory = NO_HISTORY


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # set when the row's params.logprobs is not None


def make_generator(seed: int, index: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of completion `index` of a request with `seed` (distinct per index)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return generator


class Sampler:
    """Turns logits rows into tokens. Owns only the stream used by unseeded rows.

    `eos_token_ids`: the model's end-of-sequence ids, which `min_tokens` holds back.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu",
                 eos_token_ids: Collection[int] = ()) -> None:
        self._eos_token_ids = frozenset(eos_token_ids)
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._masks: GuideMasks | None = None  # made on the first guided row

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """One token per row of `logits` (B, vocab). Raises InvalidRequestError for bad params
        before drawing anything."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        for row in rows:
            check_sampling_params(row.params)
            check_processor_params(row.params, logits.shape[1])
        raw = logits.float()
        processed = apply_logits_processors(raw, [(row.params, row.history) for row in rows], self._eos_token_ids)
        scores = self._guided(processed, rows)  # (B, vocab)
        token_ids = argmax_rows(scores)  # (B,)
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            token_ids[index] = self._sample_rows(scores[index], [rows[i] for i in sampled])
        chosen = token_ids.tolist()
        logprobs = _logprobs(raw, chosen, [row.params.logprobs for row in rows])
        return [SampledToken(t, lp) for t, lp in zip(chosen, logprobs)]

    def _guided(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """`logits` with the guided rows masked by their grammars (a copy; `logits` unchanged)."""
        guides = [row.guide for row in rows]
        if all(guide is None for guide in guides):
            return logits
        if self._masks is None:
            self._masks = GuideMasks()
        return self._masks.apply(logits, guides)

    def skip(self, row: SamplingRow, vocab: int) -> None:
        """Advance a seeded row's stream past the draws of one sampled step, choosing nothing.

        For a token sampled elsewhere from the same seed (a prefill worker's first token): the
        row's next draw here is then the one a single worker would make. Greedy and unseeded
        rows have no draws of their own to skip.
        """
        if row.generator is not None and not row.params.is_greedy:
            self._exponentials([row], vocab, row.generator.device)

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """(S, vocab) logits of non-greedy rows → (S,) sampled token ids."""
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        logits = logits / temperature[:, None]  # (S, V)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _filter_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)  # (S, V)
        return argmax_rows(probs / self._exponentials(rows, probs.shape[1], device))

    def _exponentials(self, rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
        """(S, vocab) Exp(1) draws, as -log(U) of uniform draws (4x faster than `exponential_`
        on a CPU): seeded rows from their own stream, the rest from ours."""
        noise = torch.empty((len(rows), vocab), device=device)  # (S, V)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            draws = torch.rand((len(shared), vocab), device=device, generator=self._generator)
            noise[torch.tensor(shared, device=device)] = draws
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i] = torch.rand(vocab, device=device, generator=row.generator)
        return noise.log_().neg_()


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """(B, V) → (B,) int64: each row's first highest index, NaN counted highest, as
    `torch.argmax`. On a CPU numpy's: torch's reduction kernel took 9.5 ms for 64 rows of a
    49k vocabulary where numpy's takes 1.5 (one thread, AVX2 EPYC), 63 % of a decode step's
    serving time with the forward stubbed (benchmarks/serving_overhead.py)."""
    if scores.device.type != "cpu":
        return scores.argmax(dim=-1)
    return torch.from_numpy(scores.detach().numpy().argmax(axis=1))


def logit_batch(rows: list[torch.Tensor]) -> torch.Tensor:
    """The (vocab,) logit rows as one (B, vocab) tensor: a view where they are consecutive rows
    of one tensor (a step whose every chunk asks one row: all of decode), else a copy. The
    copy of 64 rows of a 49k vocabulary took 7 of a 140 ms step, most of it faulting in fresh
    memory."""
    first, width = rows[0], rows[0].shape[0]
    consecutive = all(r.dim() == 1 and r.stride(0) == 1 and r.dtype == first.dtype for r in rows) and all(
        r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and r.storage_offset() == first.storage_offset() + i * width for i, r in enumerate(rows))
    if consecutive:
        return first.as_strided((len(rows), width), (width, 1), first.storage_offset())
    return torch.stack(rows)


def check_sampling_params(params: SamplingParams) -> None:
    """InvalidRequestError naming the first parameter the sampler cannot honour."""
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidRequestError(f"temperature={params.temperature!r} must be finite and >= 0", "temperature")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequestError(f"top_p={params.top_p!r} must be in (0, 1]", "top_p")
    if params.top_k < 0:
        raise InvalidRequestError(f"top_k={params.top_k!r} must be >= 0 (0 disables it)", "top_k")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs={params.logprobs!r} must be in 0..{MAX_LOGPROBS}", "logprobs")


CANDIDATES = 1024  # top-p rows without a top-k look for their nucleus among this many best tokens first


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, then outside its top-p nucleus.

    The nucleus is the smallest best-first set whose (top-k renormalised) mass reaches
    top_p; the best token always stays. Ties keep the lower token id first, as argmax does.

    A full sort of a 49k vocabulary costs ~4 ms a row on a CPU, more than a decode step's share:
    the nucleus and the top-k are looked for among each row's best `CANDIDATES` (or top-k) tokens
    (`topk`, linear), and the rows whose nucleus may reach past them fall back to the sort.
    """
    vocab = logits.shape[1]
    width = max([k for k in top_k if k > 0] + [CANDIDATES if any(p < 1.0 for p in top_p) else 0])
    if width * 4 >= vocab:
        return _filter_sorted(logits, top_k, top_p)
    ordered, ids = _best_first(logits, width)  # (S, W)
    k = torch.tensor([kk if kk > 0 else width for kk in top_k], device=logits.device)  # (S,)
    remove = torch.arange(width, device=logits.device)[None, :] >= k[:, None]  # (S, W)
    kept_logits = ordered.masked_fill(remove, float("-inf"))
    has_top_k = torch.tensor([kk > 0 for kk in top_k], device=logits.device)
    # Top-p mass: of the top-k (renormalised) where a row has one, else of the whole vocabulary.
    normaliser = torch.where(has_top_k, kept_logits.logsumexp(dim=-1), logits.logsumexp(dim=-1))  # (S,)
    probs = (kept_logits - normaliser[:, None]).exp()  # (S, W)
    mass = probs.cumsum(dim=-1)
    p = torch.tensor([pp if pp < 1.0 else math.inf for pp in top_p], device=logits.device)  # (S,)
    escapes = ~has_top_k & (mass[:, -1] < p)  # the nucleus may reach past the candidates
    edge = ordered[:, -1:]  # equal logits past the candidates would belong before some of them (-inf ones never count)
    ties_at_edge = torch.isfinite(edge[:, 0]) & ((logits == edge).sum(dim=-1) > (ordered == edge).sum(dim=-1))
    if bool((escapes | ties_at_edge).any()):
        return _filter_sorted(logits, top_k, top_p)
    remove |= (mass - probs) >= p[:, None]
    remove[:, 0] = False  # even a top_p that rounds to 0 in float32 (5e-324) keeps the best token
    kept = ordered.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, ids, kept)


def _best_first(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` best logits and their token ids, ordered as a stable descending sort
    orders them (equal logits: lower id first)."""
    values, ids = logits.topk(width, dim=-1)  # (S, W), equal values in no set order
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(-1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _filter_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`_filter_top_k_top_p` over a full sort of each row."""
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (S, V)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device)  # (S,)
    remove = torch.arange(vocab, device=device)[None, :] >= k[:, None]  # (S, V)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)  # (S, V)
    mass_before = probs.cumsum(dim=-1) - probs  # (S, V)
    # top_p == 1 filters nothing, not even tokens after float cumsum rounding reaches 1.
    p = torch.tensor([pp if pp < 1.0 else math.inf for pp in top_p], device=device)  # (S,)
    remove |= mass_before >= p[:, None]
    remove[:, 0] = False  # even a top_p that rounds to 0 in float32 (5e-324) keeps the best token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, chosen: list[int], wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Per row: the chosen token's logprob and the row's top-N, or None where not wanted."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    result: list[TokenLogprob | None] = [None] * len(wanted)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].log_softmax(dim=-1)  # (L, V)
    chosen_ids = torch.tensor([chosen[i] for i in rows], device=logits.device)
    chosen_lp = logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()  # (L,)
    top_n = max(wanted[i] for i in rows)
    top_lp, top_ids = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)  # (L, N)
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = wanted[i]
        top = tuple(zip(top_ids[j][:n], top_lp[j][:n]))
        result[i] = TokenLogprob(chosen[i], chosen_lp[j], top)
    return result
