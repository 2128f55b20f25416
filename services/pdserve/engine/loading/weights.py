"""Read a checkpoint from local disk: a Hugging Face directory or a GGUF file.

A directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. A `.gguf` file is read by `gguf_loader`, which returns the
same pair (HF config dict, HF-named tensors). Nothing here touches the network.
"""
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.model_config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names, in `dtype`, on `device`
    dtype: torch.dtype
    device: torch.device


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks cuda when present, else cpu. Asking for an absent cuda is a ConfigError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type not in ("cpu", "cuda") or (resolved.type == "cuda" and not torch.cuda.is_available()):
        raise ConfigError("device", str(device), "must be cpu, or cuda on a machine that has it")
    return resolved


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: the fastest dtype that keeps the checkpoint's numbers. The checkpoint's own dtype
    where it is one we serve (bf16 and float32 run on the native CPU kernels at every level),
    but float16 becomes float32 on a CPU: float32 holds every float16 exactly and the native
    kernels run it, where float16 runs on torch ops (SmolLM2-135M on an AVX2 CPU, batch-1 decode
    step: README, "Default dtype"). A GGUF file's config says bfloat16. Else float32."""
    if name == "auto":
        dtype = DTYPES.get(config.torch_dtype or "", torch.float32)
        return torch.float32 if dtype == torch.float16 and device.type == "cpu" else dtype
    if name not in DTYPES:
        raise ConfigError("dtype", name, f"supported: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model_config(path: str | Path) -> ModelConfig:
    """Only the config (no tensor is read): enough to size the KV cache before loading."""
    path = Path(path)
    if _is_gguf(path):
        from pdserve.engine.loading.gguf_loader import load_gguf_config
        _check_gguf_exists(path)
        return ModelConfig.from_hf_config(load_gguf_config(str(path)))
    return ModelConfig.from_hf_config(_read_hf_config(path))


def load_checkpoint(path: str | Path, dtype: str = "auto", device: str | torch.device | None = None,
                    cache_dir: str | None = None) -> Checkpoint:
    """Config plus every tensor, cast to the serving dtype and moved to the device.
    `cache_dir` keeps a GGUF file's conversion for the next load (HF directories ignore it)."""
    path, target = Path(path), resolve_device(device)
    serving_dtype = resolve_dtype(dtype, load_model_config(path), target)  # from the source, never from a cache
    if _is_gguf(path):
        hf_config, raw = _read_gguf(path, serving_dtype, cache_dir)  # dequantized straight to it
        tensors = iter(raw.items())
    else:
        hf_config = _read_hf_config(path)
        tensors = _read_safetensors(path)
    config = ModelConfig.from_hf_config(hf_config)
    cast = {name: t.to(device=target, dtype=serving_dtype) for name, t in tensors}
    return Checkpoint(config, cast, serving_dtype, target)


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def _read_gguf(path: Path, dtype: torch.dtype, cache_dir: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    _check_gguf_exists(path)
    from pdserve.engine.loading.gguf_loader import load_gguf
    return load_gguf(str(path), dtype, cache_dir)


def _check_gguf_exists(path: Path) -> None:
    if not path.is_file():
        raise ConfigError("model_path", str(path), "no such GGUF file")


def _read_hf_config(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ConfigError("model_path", str(path), f"no {CONFIG_FILE} (not a Hugging Face checkpoint directory)")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("model_path", str(config_path), f"invalid JSON: {err}") from None


def _safetensors_files(path: Path) -> list[Path]:
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise ConfigError("model_path", str(path), f"neither {SINGLE_FILE} nor {INDEX_FILE} found")
    shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    missing = [name for name in shard_names if not (path / name).is_file()]
    if missing:
        raise ConfigError("model_path", str(path), f"shards listed in {INDEX_FILE} are missing: {missing}")
    return [path / name for name in shard_names]


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) from every shard, in file order."""
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)
