"""Byte-level BPE from GGUF metadata (`tokenizer.ggml.model` = "gpt2"): GPT-2, Llama 3, SmolLM,
Qwen2/Qwen3. The file stores the vocabulary, the merges and the name of llama.cpp's
pre-tokenizer (`tokenizer.ggml.pre`), which is everything needed to rebuild it exactly.
"""
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.common.errors import ConfigError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # Qwen2's tokenizer.json; llama.cpp spells the (?i:...) group out case by case
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_FAMILY = ("default", "gpt2", "gpt-2", "olmo", "mpt", "jais")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_SPLITS = {  # pre-tokenizer name → the regex its text is split by before the byte mapping
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def byte_level_backend(meta: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    """The BPE model, pre-tokenizer and decoder; ConfigError for a missing merge list or an
    unknown pre-tokenizer. Special tokens are the caller's."""
    if "tokenizer.ggml.merges" not in meta:
        raise ConfigError("tokenizer.ggml.merges", None, "a byte-level BPE vocabulary needs its merges")
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    backend = BackendTokenizer(models.BPE(vocab=_byte_level_vocab(tokens), merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's named pre-tokenizer as the `tokenizers` equivalent; ConfigError if unknown."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_FAMILY:
        return byte_level
    if name in _DIGITS_THEN_GPT2:  # every digit on its own, then the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    supported = ", ".join(_GPT2_FAMILY + _DIGITS_THEN_GPT2 + tuple(_SPLITS))
    raise ConfigError("tokenizer.ggml.pre", name, f"unsupported pre-tokenizer; supported: {supported}")


def is_byte_level_spelling(token: str) -> bool:
    """Whether `token` is written in the byte alphabet (so its id survives as an added token)."""
    return set(token) <= _SPELLED


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token → id, respelling in the byte alphabet any token the file stores as plain text."""
    alphabet = byte_alphabet()
    return {
        token if is_byte_level_spelling(token) else "".join(alphabet[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable bytes stand for themselves, the
    other 68 take the code points from 256 upward, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(others)})
    return mapping


_SPELLED = frozenset(byte_alphabet().values())
