"""N-gram (prompt lookup) drafting: no model, only the sequence's own tokens.

The longest suffix of the tokens so far, between `min_n` and `max_n` tokens, is looked for
earlier in the same tokens (prompt and output); the tokens that followed its latest earlier
occurrence are the draft. A summary, an edit or code that quotes its prompt repeats such spans,
and each drafted token the target agrees with is a token decoded without a step of its own.

The search is `bytes.rfind` over the tokens as 4-byte words (C speed; an unaligned hit is
skipped), so a 2,000-token sequence costs microseconds a step.
"""
from array import array
from collections.abc import Sequence

WORD = 4  # bytes of one token id in the searched buffer


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram window {min_n}..{max_n}: need 1 <= min <= max")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens to follow `token_ids`; [] when no suffix recurs."""
        if num_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        words = array("i", token_ids).tobytes()
        total = len(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = _latest_earlier(words, words[(total - n) * WORD:], (total - 1) * WORD)
            if start is not None:
                follow = start // WORD + n
                return list(token_ids[follow:follow + num_tokens])
        return []


def _latest_earlier(words: bytes, pattern: bytes, end: int) -> int | None:
    """Byte offset of the latest token-aligned occurrence of `pattern` that ends before the
    buffer's last token (so at least one token follows it); None if there is none."""
    while True:
        at = words.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % WORD == 0:
            return at
        end = at + len(pattern) - 1  # look again, strictly left of this unaligned hit
