"""Streamed text: token ids in, text deltas out, stop strings honoured.

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                   params.spaces_between_special_tokens, tokenizer.added_token_ids)
    stops = StopChecker(params.stop, params.include_stop_str_in_output)
    each step:   piece = stops.feed(detok.add(new_ids)); send piece.text; finish if piece.stopped
    at the end:  send stops.feed(detok.flush()).text + stops.flush()

Contract: the concatenation of everything sent equals the decode of all generated ids,
cut at the first stop string (kept or not, per `include_stop_str_in_output`).
"""
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what decode yields for an incomplete UTF-8 sequence
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first generated ones


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas, never splitting a character.

    Each step decodes a short window, `ids[prefix:]`, and emits what it adds beyond
    `ids[prefix:read]` (decoding with a token of left context keeps word-leading spaces
    right for tokenizers that strip them at the start of a decode).

        # | prompt / already settled | prefix .. read: context | read ..: not yet emitted |

    While the window's text ends in U+FFFD the last token ends mid-character: hold it back
    until the next token completes it. `flush()` gives up what is still held.

    vLLM's special-token options: `skip_special_tokens` leaves special tokens out of the text;
    with it off, `spaces_between_special_tokens=False` writes an added token that follows
    another added token as its bare text, never with the separator the tokenizer's decoder
    would put between them (a WordPiece or Metaspace decoder's space; byte-level decoders put
    none, so for them the two settings give the same text). `added_token_ids` names them.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, added_token_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        joins_added = not (skip_special_tokens or spaces_between_special_tokens)
        self._added_ids = added_token_ids if joins_added else frozenset()
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back (an unfinished character decodes as U+FFFD); call once at the end."""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        """The text of ids[start:end], cut before each added token that follows another and
        decoded piece by piece, so no separator goes between the two."""
        ids = self._ids[start:end]
        cuts = [i for i in range(1, len(ids)) if ids[i] in self._added_ids and ids[i - 1] in self._added_ids]
        bounds = [0, *cuts, len(ids)]
        return "".join(self._tokenizer.decode(ids[a:b], skip_special_tokens=self._skip_special)
                       for a, b in zip(bounds, bounds[1:]))


@dataclass(frozen=True, slots=True)
class StopPiece:
    text: str  # safe to send now
    stopped: bool  # a stop string was found; nothing more may be sent


class StopChecker:
    """Finds stop strings in streamed text, even when one spans several deltas.

    Text that could be the start of a stop string is held back until the next delta
    settles it. On a match the output ends just before the stop string, or just after it
    with `include_stop_str_in_output`.
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop_str_in_output
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopPiece:
        """The part of `held + delta` that is final now. After a stop, always empty."""
        if self._stopped:
            return StopPiece("", True)
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._held, self._stopped = "", True
            return StopPiece(text[: start + len(stop)] if self._include else text[:start], True)
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep:]
        return StopPiece(text[: len(text) - keep], False)

    def flush(self) -> str:
        """Held-back text, released when generation ends for another reason."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that completes first; the longest on a tie.

        "Completes first" makes the result independent of how the text was cut into deltas:
        a stream stops at the first point where any stop string is complete.
        """
        found = [(text.find(s) + len(s), text.find(s), s) for s in self._stops if s in text]
        if not found:
            return None
        _, start, stop = min(found)
        return start, stop

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[len(text) - length:]):
                    best = length
                    break
        return best
