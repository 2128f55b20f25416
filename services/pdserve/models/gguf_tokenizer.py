"""Build a `tokenizers` tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, token types, special ids and, by
`tokenizer.ggml.model`, either byte-level BPE merges and llama.cpp's pre-tokenizer name ("gpt2":
gguf_byte_level) or SentencePiece scores ("llama": gguf_sentencepiece). Both are rebuilt to
tokenize as llama.cpp does; whatever a file asks for that is not served raises ConfigError
naming its key. Conversion takes about 0.1 s for SmolLM2 (the metadata is parsed by `gguf_file`);
the result may also be cached in a directory the caller chooses, keyed by the file's path, size
and mtime.
"""
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.models.conversion_cache import cache_key, write_file_atomically
from pdserve.common.errors import ConfigError
from pdserve.models.gguf_byte_level import byte_level_backend, is_byte_level_spelling
from pdserve.models.gguf_file import read_gguf
from pdserve.models.gguf_sentencepiece import sentencepiece_backend
from pdserve.models.tokenizer_files import TokenizerSpec

CONVERTER_VERSION = 2  # bump when conversion output changes, to invalidate caches
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp token types
_SPECIAL_KEYS = ("bos", "eos", "unknown", "eot", "eom")  # tokenizer.ggml.<name>_token_id
_SPECIAL_NAMES = ("bos", "eos", "unknown", "padding")  # special whatever their token type says
_SENTENCEPIECE_DEFAULTS = {"bos": 1, "eos": 2, "unknown": 0}  # llama.cpp's, when the file names none
_END_OF_TURN = frozenset((  # control tokens llama.cpp ends a generation on, known by their text
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>",
))


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
    if model_type not in ("gpt2", "llama"):
        raise ConfigError("tokenizer.ggml.model", model_type,
                          "supported: byte-level BPE ('gpt2') and SentencePiece ('llama') GGUF tokenizers")
    if "tokenizer.ggml.tokens" not in meta:
        raise ConfigError("tokenizer.ggml.tokens", None, "the file has no vocabulary")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    ids = _special_ids(meta, len(tokens), _SENTENCEPIECE_DEFAULTS if model_type == "llama" else {})
    if model_type == "gpt2":
        backend = byte_level_backend(meta, tokens)
        _add_special_tokens(backend, tokens, token_types, ids, is_byte_level_spelling)
        eos_ids = _eos_ids(ids)
    else:
        backend = sentencepiece_backend(meta, tokens, ids.get("unknown"))
        _add_special_tokens(backend, tokens, token_types, ids, lambda token: True)
        eos_ids = _eos_ids(ids, _end_of_turn_ids(tokens, token_types))
    backend.post_processor = _bos_eos_processor(meta, tokens, ids, add_bos_default=model_type == "llama")
    return backend, TokenizerSpec(ids.get("bos"), eos_ids, meta.get("tokenizer.chat_template"))


def _special_ids(meta: dict[str, Any], num_tokens: int, defaults: dict[str, int]) -> dict[str, int]:
    """bos/eos/unknown/eot/eom ids the file names (else `defaults`), ConfigError if out of range;
    and the padding id if in range (nothing is padded here: an id past the end, which llama.cpp
    ignores too, changes nothing)."""
    ids = {}
    for name in _SPECIAL_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        token_id = meta.get(key, defaults.get(name))
        if token_id is not None and not 0 <= token_id < num_tokens:
            raise ConfigError(key, token_id, f"not an id of the {num_tokens}-token vocabulary")
        if token_id is not None:
            ids[name] = token_id
    padding = meta.get("tokenizer.ggml.padding_token_id")
    if padding is not None and 0 <= padding < num_tokens:
        ids["padding"] = padding
    return ids


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int],
                        ids: dict[str, int], can_add: Callable[[str], bool]) -> None:
    """Control and unknown tokens, and the bos/eos/unknown/padding ones whatever their type,
    match whole and are special; user-defined ones match whole but are text. `can_add(token)`
    says whether a token is spelled as the model spells it (a byte-level one respelled would get
    a new id)."""
    named = {ids[name] for name in _SPECIAL_NAMES if name in ids}
    special = [i for i, kind in enumerate(token_types) if kind in (CONTROL, UNKNOWN)]
    user_defined = [i for i, kind in enumerate(token_types) if kind == USER_DEFINED and i not in named]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in sorted(named.union(special)) if can_add(tokens[i])])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i in user_defined if can_add(tokens[i])])


def _end_of_turn_ids(tokens: list[str], token_types: list[int]) -> list[int]:
    """Control tokens that end a turn by llama.cpp's list of names. Its converter writes one eos
    id for a SentencePiece vocabulary, the tokenizer's (Gemma 3's <eos>, Phi-3's <|endoftext|>),
    not the chat turn's end (<end_of_turn>, <|end|>). Byte-level files are left to their ids:
    theirs name the turn's end as eos, and adding <|endoftext|> would change where they stop."""
    return [i for i, (token, kind) in enumerate(zip(tokens, token_types)) if kind == CONTROL and token in _END_OF_TURN]


def _eos_ids(ids: dict[str, int], extra: Sequence[int] = ()) -> tuple[int, ...]:
    named = [ids[name] for name in ("eos", "eot", "eom") if name in ids]
    return tuple(dict.fromkeys([*named, *extra]))


def _bos_eos_processor(meta: dict[str, Any], tokens: list[str], ids: dict[str, int],
                       add_bos_default: bool) -> processors.TemplateProcessing | None:
    """What `add_special_tokens=True` adds: BOS and/or EOS, as `tokenizer.ggml.add_{bos,eos}_token` say."""
    edges = {}  # "bos"/"eos" → (token, id)
    for name, default in (("bos", add_bos_default), ("eos", False)):
        if meta.get(f"tokenizer.ggml.add_{name}_token", default):
            if name not in ids:
                raise ConfigError(f"tokenizer.ggml.{name}_token_id", None, f"add_{name}_token is set but no id is")
            edges[name] = (tokens[ids[name]], ids[name])
    if not edges:
        return None
    bos = [edges["bos"][0]] if "bos" in edges else []
    eos = [edges["eos"][0]] if "eos" in edges else []
    return processors.TemplateProcessing(single=" ".join([*bos, "$A", *eos]),
                                         pair=" ".join([*bos, "$A", *eos, *bos, "$B", *eos]),
                                         special_tokens=list(dict.fromkeys(edges.values())))


def _cache_paths(path: str, cache_dir: str) -> tuple[Path, Path]:
    key = cache_key(path, "tokenizer", CONVERTER_VERSION)
    root = Path(cache_dir)
    return root / f"{key}.tokenizer.json", root / f"{key}.spec.json"


def _write_text(target: Path, text: str) -> None:
    write_file_atomically(target, lambda scratch: scratch.write_text(text, encoding="utf-8"))
