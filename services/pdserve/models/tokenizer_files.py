"""Read a Hugging Face checkpoint directory's tokenizer files.

    tokenizer.json            vocabulary, merges, pre-tokenizer, post-processor (BOS), decoder
    tokenizer_config.json     bos/eos token strings, chat template (older checkpoints)
    chat_template.jinja       chat template (newer checkpoints; wins over the config's)
    generation_config.json    extra end-of-generation ids (e.g. Llama 3's <|eot_id|>)
    config.json               bos/eos ids when the tokenizer files do not name them
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from pdserve.common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What a checkpoint says about its tokenizer beyond the vocabulary."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # any of these ends a generation
    chat_template: str | None

    def to_json(self) -> dict[str, Any]:
        return {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
                "chat_template": self.chat_template}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TokenizerSpec":
        return cls(data["bos_token_id"], tuple(data["eos_token_ids"]), data["chat_template"])


def read_hf_tokenizer(directory: str) -> tuple[BackendTokenizer, TokenizerSpec]:
    """The backend tokenizer and spec of an HF checkpoint dir; ConfigError if tokenizer.json is missing."""
    root = Path(directory)
    if not (root / "tokenizer.json").is_file():
        raise ConfigError("model", directory, "directory has no tokenizer.json")
    backend = BackendTokenizer.from_file(str(root / "tokenizer.json"))
    tok_config = _read_json(root / "tokenizer_config.json")
    model_config = _read_json(root / "config.json")
    gen_config = _read_json(root / "generation_config.json")
    bos_id = _token_id(backend, tok_config.get("bos_token"))
    if bos_id is None:
        bos_id = model_config.get("bos_token_id")
    eos_ids = _unique(
        [_token_id(backend, tok_config.get("eos_token"))]
        + _as_list(gen_config.get("eos_token_id"))
        + _as_list(model_config.get("eos_token_id"))
    )
    return backend, TokenizerSpec(bos_id, eos_ids, _chat_template(root, tok_config))


def _chat_template(root: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _token_id(backend: BackendTokenizer, token: str | dict[str, Any] | None) -> int | None:
    """Id of a token given as a string or as an AddedToken dict ({"content": ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _as_list(value: int | list[int] | None) -> list[int | None]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _unique(ids: list[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(path.name, str(path), f"invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(path.name, str(path), "must hold a JSON object")
    return data
