"""A checkpoint's default sampling parameters, from its `generation_config.json`, as vLLM reads them.

vLLM's `--generation-config auto` (its default) applies the checkpoint's `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`) to every request
that leaves the field unset; `vllm` applies none; a folder reads that folder's file instead.
Like vLLM (which reads the file through `GenerationConfig.to_diff_dict()`), a value equal to
transformers' own default is no default at all: `top_k: 50` in the file changes nothing.
"""
import json
import logging
from pathlib import Path

from pdserve.common.errors import ConfigError

GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a folder
# generation_config.json key -> request field, and transformers' default (None: none)
_FIELDS: dict[str, tuple[str, float | int | None]] = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}
_log = logging.getLogger(__name__)


def generation_defaults(source: str, model: str) -> dict[str, float | int]:
    """Request field -> default value. `source`: auto (the `model` folder's file, none for a
    GGUF file, which carries no sampling defaults), vllm (none) or a folder."""
    if source == "vllm":
        return {}
    folder = Path(model if source == "auto" else source)
    if source != "auto" and not folder.is_dir():
        raise ConfigError("generation_config", source, "must be auto, vllm or a folder with generation_config.json")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("generation_config", str(path), f"unreadable: {exc}") from None
    defaults = {field: config[key] for key, (field, hf_default) in _FIELDS.items()
                if _is_number(config.get(key)) and config[key] != hf_default}
    if defaults:
        _log.info("default sampling parameters from the model's generation_config.json: %s "
                  "(--generation-config vllm turns them off)", defaults)
    return defaults


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
