"""Structured output in the worker: one grammar matcher per guided sequence, and the token
bitmask those matchers put on a step's logits rows, batched.

`GuideCompiler` is built once per worker from its tokenizer (llguidance's token trie, about
0.3 s for a 50k vocabulary) and compiles each distinct guide once: a pristine matcher per
guide is kept (LRU) and every sequence gets a deep copy, which is cheap. A worker compiles a
request's guide on a thread of its own before the request reaches the engine thread
(`prepare`), so a stream of distinct schemas does not stall every step; the engine thread then
finds it compiled. A `GuideMatcher`
advances with each token the sequence accepts (sampled here, or sampled by a prefill worker
and handed over), so its state always matches the sequence's output tokens.
"""
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from pdserve.common.errors import InvalidRequestError
from pdserve.common.guides import grammar_of
from pdserve.common.request import Guide

MAX_CACHED_GUIDES = 256
_BITS = 32  # llguidance packs the mask into int32 words, token i at bit i % 32 of word i // 32


class GuideMatcher:
    """One sequence's position in its guide's grammar."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`. A token the grammar refuses leaves the matcher in error
        (see `error`); the engine ends the sequence with it."""
        self.matcher.consume_token(token_id)

    def advance(self, token_id: int) -> str | None:
        """`accept(token_id)`, sampled here or by a prefill worker (the first token); why the
        grammar refused it, if it did."""
        self.accept(token_id)
        error = self.error
        if error is None:
            return None
        return (f"the output's guide refused token {token_id} ({error.splitlines()[0]}); "
                "a guide that needs bytes no token of this model spells ends this way")

    @property
    def is_finished(self) -> bool:
        """The guide is complete: nothing (not even EOS) may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GuideCompiler:
    """Compiles guides for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[Guide, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache only: compiles run outside it, on any thread

    def matcher(self, guide: Guide, done: Sequence[int] = ()) -> GuideMatcher:
        """A fresh matcher of `guide`, past the tokens `done` already generated under it (a migrated
        request's); InvalidRequestError if it does not compile or `done` does not follow it."""
        matcher = GuideMatcher(self._pristine(guide).deep_copy())
        for token_id in done:
            refusal = matcher.advance(token_id)
            if refusal is not None:
                raise InvalidRequestError(f"the tokens already generated do not follow the guide: {refusal}", "guide")
        return matcher

    def prepare(self, guide: Guide) -> None:
        """Compile `guide` now (on the caller's thread) and keep it; InvalidRequestError if it does not compile."""
        self._pristine(guide)

    def _pristine(self, guide: Guide) -> LLMatcher:
        with self._lock:
            pristine = self._compiled.get(guide)
            if pristine is not None:
                self._compiled.move_to_end(guide)
                return pristine
        pristine = LLMatcher(self._tokenizer, grammar_of(guide), log_level=0)
        if pristine.is_error():
            raise InvalidRequestError(f"invalid guide: {pristine.get_error()}", "guide")
        with self._lock:
            self._compiled[guide] = pristine
            if len(self._compiled) > MAX_CACHED_GUIDES:
                self._compiled.popitem(last=False)
        return pristine


class GuideMasks:
    """Applies the guided rows' token bitmasks to a step's logits (one fill for the batch)."""

    def __init__(self) -> None:
        self._executor = LLExecutor()

    def apply(self, logits: torch.Tensor, guides: Sequence[GuideMatcher | None]) -> torch.Tensor:
        """`logits` (B, V) with every token a row's guide forbids at -inf; unguided rows and
        `logits` itself are left as they are (the raw rows still give the logprobs)."""
        rows = [i for i, guide in enumerate(guides) if guide is not None]
        if not rows:
            return logits
        vocab = logits.shape[1]
        num_words = (vocab + _BITS - 1) // _BITS
        bitmask = torch.full((len(rows), num_words), -1, dtype=torch.int32)  # (G, W), CPU: llguidance fills it
        self._executor.unsafe_compute_mask_ptr(
            [(guides[i].matcher, j) for j, i in enumerate(rows)], bitmask.data_ptr(), num_words * 4, len(rows))
        shifts = torch.arange(_BITS, dtype=torch.int32)  # (32,)
        allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]  # (G, V)
        index = torch.tensor(rows, device=logits.device)
        masked = logits.clone()
        masked[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return masked
