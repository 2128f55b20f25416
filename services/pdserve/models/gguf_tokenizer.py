"""Build a `tokenizers` tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, merges, token types, special
ids and the name of llama.cpp's pre-tokenizer. For byte-level BPE (`tokenizer.ggml.model`
= "gpt2") that is everything needed to rebuild the tokenizer exactly. Conversion takes about
0.1 s for SmolLM2 (the metadata is parsed by `gguf_file`); the result may also be cached in a
directory the caller chooses, keyed by the file's path, size and mtime.
"""
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.models.conversion_cache import cache_key, write_file_atomically
from pdserve.common.errors import ConfigError
from pdserve.models.gguf_file import read_gguf
from pdserve.models.tokenizer_files import TokenizerSpec

CONVERTER_VERSION = 1  # bump when conversion output changes, to invalidate caches
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_FAMILY = ("default", "gpt2", "gpt-2", "olmo", "mpt", "jais")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_FAMILY = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")


def read_gguf_tokenizer(path: str, cache_dir: str | None = None) -> tuple[BackendTokenizer, TokenizerSpec]:
    """The tokenizer a GGUF file describes. With `cache_dir`, reuse or store the conversion there."""
    cached = _cache_paths(path, cache_dir) if cache_dir else None
    if cached and cached[0].is_file() and cached[1].is_file():
        try:
            spec = TokenizerSpec.from_json(json.loads(cached[1].read_text(encoding="utf-8")))
            return BackendTokenizer.from_file(str(cached[0])), spec
        except Exception:  # a damaged cache entry (tokenizers raises a bare Exception): convert again
            pass
    backend, spec = _convert(read_gguf(path).metadata)
    if cached:
        _write_text(cached[0], backend.to_str())
        _write_text(cached[1], json.dumps(spec.to_json()))
    return backend, spec


def _convert(meta: dict[str, Any]) -> tuple[BackendTokenizer, TokenizerSpec]:
    model_type = meta.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ConfigError("tokenizer.ggml.model", model_type,
                          "only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE(vocab=_byte_level_vocab(tokens), merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", []))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos_ids = tuple(dict.fromkeys(meta[key] for key in eos_keys if key in meta))
    return backend, TokenizerSpec(bos_id, eos_ids, meta.get("tokenizer.chat_template"))


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's named pre-tokenizer as the `tokenizers` equivalent; ConfigError if unknown."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_FAMILY:
        return byte_level
    if name in _DIGITS_THEN_GPT2:  # every digit on its own, then the GPT-2 split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _LLAMA3_FAMILY:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    supported = ", ".join(_GPT2_FAMILY + _DIGITS_THEN_GPT2 + _LLAMA3_FAMILY)
    raise ConfigError("tokenizer.ggml.pre", name, f"unsupported pre-tokenizer; supported: {supported}")


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token → id, respelling in the byte alphabet any token the file stores as plain text."""
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    return {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens match whole and are special; user-defined ones match whole but are text."""
    spelled = set(byte_alphabet().values())
    kinds = {CONTROL: True, USER_DEFINED: False}
    added = [
        AddedToken(token, special=kinds[kind], normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind in kinds and set(token) <= spelled  # respelled ones would get new ids
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable bytes stand for themselves, the
    other 68 take the code points from 256 upward, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(others)})
    return mapping


def _cache_paths(path: str, cache_dir: str) -> tuple[Path, Path]:
    key = cache_key(path, "tokenizer", CONVERTER_VERSION)
    root = Path(cache_dir)
    return root / f"{key}.tokenizer.json", root / f"{key}.spec.json"


def _write_text(target: Path, text: str) -> None:
    write_file_atomically(target, lambda scratch: scratch.write_text(text, encoding="utf-8"))
