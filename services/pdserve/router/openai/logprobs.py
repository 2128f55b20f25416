"""Worker logprobs (token ids) in the two OpenAI formats (token strings).

Completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a dict that also holds
the sampled token, as vLLM does) and `text_offset` (each token's start in the choice's text);
with `echo`, the prompt's tokens come first, the very first with null logprobs.
Chat: `content[]` entries with `token`, `logprob`, `bytes` and `top_logprobs[]` (top-N only).
A logprob of -inf (a token the sampler could not pick) is written as -9999.0, since JSON has
no infinities.
"""
from collections.abc import Sequence
from functools import lru_cache

from pdserve.common.request import TokenLogprob
from pdserve.router.openai.prompts import PromptTokenizer
from pdserve.router.openai.responses import ChatTokenLogprob, CompletionLogprobs, TopLogprob

_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


class LogprobFormatter:
    def __init__(self, tokenizer: PromptTokenizer, cache_size: int = 65536) -> None:
        self._tokenizer = tokenizer
        self.token_text = lru_cache(maxsize=cache_size)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, logprobs: Sequence[TokenLogprob], num_top: int, text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Logprobs of consecutive tokens whose text starts at `text_offset`; also the offset
        after the last of them (feed it to the next call of the same choice)."""
        out = CompletionLogprobs()
        for entry in logprobs:
            token = self.token_text(entry.token_id)
            top = {self.token_text(token_id): _finite(lp) for token_id, lp in entry.top[:num_top]}
            top[token] = _finite(entry.logprob)
            out.tokens.append(token)
            out.token_logprobs.append(_finite(entry.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out, text_offset

    def echoed_prompt(
        self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob], num_top: int
    ) -> tuple[CompletionLogprobs, int]:
        """An echoed prompt's entries, its text starting at offset 0: the first token without a
        logprob (nothing precedes it), then `logprobs` (prompt tokens 1..); the offset after it."""
        first = self.token_text(prompt_ids[0])
        out = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        rest, text_offset = self.completion(logprobs, num_top, len(first))
        out.tokens += rest.tokens
        out.token_logprobs += rest.token_logprobs
        out.top_logprobs += rest.top_logprobs
        out.text_offset += rest.text_offset
        return out, text_offset

    def chat(self, logprobs: Sequence[TokenLogprob], num_top: int) -> list[ChatTokenLogprob]:
        return [
            ChatTokenLogprob(
                **self._top(entry.token_id, entry.logprob).model_dump(),
                top_logprobs=[self._top(token_id, lp) for token_id, lp in entry.top[:num_top]],
            )
            for entry in logprobs
        ]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))
