"""Random text that encodes to an exact number of tokens with the served model's tokenizer.

Random token ids are decoded, re-encoded and trimmed or topped up until the text encodes
to the requested count, because decode∘encode is not the identity (merges across token
boundaries, partial UTF-8 sequences).
"""
from typing import Protocol

import numpy as np

from pdserve.common.errors import ConfigError

MAX_FIT_ROUNDS = 32
MAX_DRAWS_PER_ID = 64


class TextTokenizer(Protocol):
    """The part of `pdserve.models.tokenizer.Tokenizer` the benchmark uses."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class RandomText:
    """Draws token-exact random text; the same seed gives the same sequence of texts."""

    def __init__(self, tokenizer: TextTokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self._is_usable: dict[int, bool] = {}

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _usable(self, token_id: int) -> bool:
        """Ordinary tokens only. Special tokens (`<|im_start|>`, `<s>`) would break the chat
        template: they decode to nothing or to a `<...>` spelling. Byte pieces of a multi-byte
        character decode to U+FFFD alone and would put replacement characters in prompts."""
        if token_id not in self._is_usable:
            piece = self.tokenizer.decode([token_id]).strip()
            is_special = piece.startswith("<") and piece.endswith(">")
            self._is_usable[token_id] = bool(piece) and not is_special and "\ufffd" not in piece
        return self._is_usable[token_id]

    def _draw_ids(self, count: int) -> list[int]:
        ids: list[int] = []
        for _ in range(count * MAX_DRAWS_PER_ID):
            if len(ids) == count:
                break
            token_id = int(self.rng.integers(0, self.tokenizer.vocab_size))
            if self._usable(token_id):
                ids.append(token_id)
        return ids

    def text(self, num_tokens: int, head: str = "") -> str:
        """Text T with num_tokens(head + T) == num_tokens(head) + num_tokens.

        `head` is what T will be appended to (a shared prefix), so merges at the seam are
        counted. Raises ConfigError if no such text is found within MAX_FIT_ROUNDS.
        """
        if num_tokens == 0:
            return ""
        base = self.num_tokens(head) if head else 0
        ids = self._draw_ids(num_tokens)
        for _ in range(MAX_FIT_ROUNDS):
            text = self.tokenizer.decode(ids)
            excess = self.num_tokens(head + text) - base - num_tokens
            if excess == 0:
                return text
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids = ids[: len(ids) - excess] if excess > 0 else ids + self._draw_ids(-excess)
        raise ConfigError("tokenizer", num_tokens, "could not build random text of exactly this many tokens")
