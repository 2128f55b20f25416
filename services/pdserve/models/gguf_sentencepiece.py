"""SentencePiece vocabularies from GGUF metadata (`tokenizer.ggml.model` = "llama": Llama 2,
Mistral/Mixtral, Phi-3, Gemma 3), tokenized as llama.cpp tokenizes them.

llama.cpp starts from a text's characters and keeps merging the adjacent pair whose
concatenation is the vocabulary token with the best score (`tokenizer.ggml.scores`); a
character no token spells becomes its UTF-8 byte tokens (<0x41>). A `tokenizers` BPE model with
byte fallback does the same when its merges are every split of a token into two tokens, ranked
by that token's score. The file lists no merges (a few converters write some; llama.cpp ignores
them, and so do we).

Before that, spaces become ▁, and with `tokenizer.ggml.add_space_prefix` (the default; Gemma's
files turn it off) a space goes in front of the text and of every stretch after a special or
user-defined token, which llama.cpp cuts out of the text first. A normalizer does this: it runs
on each stretch between added tokens. (transformers' conversion of Llama-architecture files uses
Metaspace with prepend_scheme "first" instead, which prefixes only the start, and not a text that
already starts with a space; the HF tokenizer.json of Mixtral and Phi-3 agree with llama.cpp.)
"""
from typing import Any

from tokenizers import decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.common.errors import ConfigError

SPACE = "\u2581"  # ▁, SentencePiece's visible space
_UNSERVED = {  # keys that ask for behaviour llama.cpp's SentencePiece tokenizer does not have
    "tokenizer.ggml.remove_extra_whitespaces": "collapsing runs of whitespace is not supported",
    "tokenizer.ggml.precompiled_charsmap": "SentencePiece's precompiled normalization is not supported",
    "tokenizer.ggml.add_sep_token": "appending a separator token is not supported",
}


def sentencepiece_backend(meta: dict[str, Any], tokens: list[str], unk_id: int | None) -> BackendTokenizer:
    """The BPE model, normalizer and decoder; ConfigError for what the file asks that this does
    not do. Special tokens are the caller's."""
    _refuse_unserved(meta)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ConfigError("tokenizer.ggml.scores", None if scores is None else len(scores),
                          f"a SentencePiece vocabulary needs one score per token ({len(tokens)})")
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    backend = BackendTokenizer(models.BPE(
        vocab=vocab, merges=merges_by_score(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True))
    to_space = normalizers.Replace(" ", SPACE)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), to_space])
        backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        backend.normalizer = to_space
        backend.decoder = decoders.Sequence(steps)
    return backend


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair that spells a token, best token score first. Ties between
    tokens go to the lower id (llama.cpp breaks them by position in the text, which no fixed
    ranking can; SentencePiece scores rarely tie)."""
    vocab = set(tokens)
    ranked = [
        (-scores[index], index, cut, token[:cut], token[cut:])
        for index, token in enumerate(tokens)
        for cut in range(1, len(token))
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _refuse_unserved(meta: dict[str, Any]) -> None:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre != "default":
        raise ConfigError("tokenizer.ggml.pre", pre, "a SentencePiece vocabulary takes no pre-tokenizer")
    for key, reason in _UNSERVED.items():
        if meta.get(key):
            raise ConfigError(key, meta[key] if not isinstance(meta[key], list) else "<array>", reason)
