"""llama.cpp's SentencePiece ("llama") tokenization, written plainly from its rules, as a second
reference beside transformers (whose GGUF conversion differs from llama.cpp for Llama-family
files on text after a special token and text starting with a space):

1. Control, unknown and user-defined tokens are cut out of the text whole, the longest first.
2. Each stretch of text left gets a leading space when `add_space_prefix` (the default) and it
   is first or follows such a token; its spaces become ▁.
3. From its characters, repeatedly merge the adjacent pair whose concatenation is the token with
   the highest score (the leftmost on a tie); a symbol no token spells becomes its UTF-8 bytes.
"""
from collections.abc import Sequence

from tests.unit.models.gguf_vocab_builders import CONTROL, UNKNOWN, USER_DEFINED

WHOLE = (CONTROL, UNKNOWN, USER_DEFINED)


def llama_cpp_encode(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int], text: str,
                     add_space_prefix: bool = True) -> list[int]:
    """Token ids of `text`, without BOS/EOS (llama.cpp's parse_special on)."""
    ids = {token: index for index, token in enumerate(tokens)}
    whole = sorted((i for i, kind in enumerate(token_types) if kind in WHOLE), key=lambda i: -len(tokens[i]))
    fragments: list[str | int] = [text]
    for token_id in whole:
        fragments = [piece for fragment in fragments for piece in _cut(fragment, tokens[token_id], token_id)]
    output: list[int] = []
    follows_token = True
    for fragment in fragments:
        if isinstance(fragment, int):
            output.append(fragment)
            follows_token = True
            continue
        if add_space_prefix and follows_token:
            fragment = " " + fragment
        output += _merge_by_score(fragment.replace(" ", "▁"), ids, scores)
        follows_token = False
    return output


def _cut(fragment: str | int, token: str, token_id: int) -> list[str | int]:
    if isinstance(fragment, int):
        return [fragment]
    pieces: list[str | int] = []
    for index, part in enumerate(fragment.split(token)):
        if index:
            pieces.append(token_id)
        if part:
            pieces.append(part)
    return pieces


def _merge_by_score(text: str, ids: dict[str, int], scores: Sequence[float]) -> list[int]:
    symbols = list(text)
    while True:
        best = None  # (score, position)
        for position in range(len(symbols) - 1):
            token_id = ids.get(symbols[position] + symbols[position + 1])
            if token_id is not None and (best is None or scores[token_id] > best[0]):
                best = (scores[token_id], position)
        if best is None:
            break
        position = best[1]
        symbols[position:position + 2] = [symbols[position] + symbols[position + 1]]
    output = []
    for symbol in symbols:
        if symbol in ids:
            output.append(ids[symbol])
        else:
            output += [ids[f"<0x{byte:02X}>"] for byte in symbol.encode("utf-8")]
    return output
