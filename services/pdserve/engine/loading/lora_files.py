"""Read a LoRA adapter saved by PEFT: `adapter_config.json` + `adapter_model.safetensors`.

Only what the decoder can apply is accepted: plain LoRA (no DoRA, no bias training, no
`modules_to_save`) on the attention and MLP projections; anything else is refused by name
rather than silently dropped, so an adapter never serves output it was not trained for.

An adapter's id is a digest of its two files' bytes: every process that loads the same files
gets the same id, so the id can sit in KV block keys (`kvcache/block_key.py`) and a prefill and
a decode worker agree on an adapter without being told, while different weights never share an
id, whatever they are called.
"""
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load

from pdserve.common.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGET_MODULES)
                          + r")\.lora_([AB])\.weight$")
# A mixture's experts and router (Mixtral's block_sparse_moe; Qwen-MoE's mlp.experts and mlp.gate,
# per expert or as PEFT's 3-D parameters): not LoRA targets, refused by name
_MOE_TENSOR = re.compile(r"(?:^|\.)layers\.\d+\.(?:block_sparse_moe|mlp\.(?:experts|gate)\b)")
_ID_MASK = (1 << 63) - 1  # block keys pack the id as a signed 64-bit integer


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One projection's low-rank pair, scaled: delta(x) = x @ a.T @ b.T."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r), already multiplied by the adapter's scaling
    rank: int


@dataclass(frozen=True, slots=True)
class LoraCheckpoint:
    lora_id: int
    path: str
    rank: int  # the largest rank among its modules
    modules: dict[tuple[int, str], LoraModule]  # (layer index, projection name) -> pair


def read_lora_checkpoint(path: str | Path) -> LoraCheckpoint:
    """The adapter in folder `path`, its tensors float32 on the CPU; ConfigError naming what is wrong."""
    folder = Path(path)
    config_bytes, weights_bytes = _read(folder / CONFIG_FILE), _read(folder / WEIGHTS_FILE)
    config = _parse_config(folder, config_bytes)
    try:
        tensors = load(weights_bytes)
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise ConfigError("lora_path", str(folder), f"{WEIGHTS_FILE} is not a safetensors file: {exc}") from None
    modules = _pair_modules(folder, tensors, config)
    if not modules:
        raise ConfigError("lora_path", str(folder), f"no LoRA weights of {', '.join(TARGET_MODULES)} found")
    digest = hashlib.sha256(config_bytes + b"\0" + weights_bytes).digest()
    lora_id = int.from_bytes(digest[:8], "little") & _ID_MASK
    return LoraCheckpoint(lora_id, str(folder), max(m.rank for m in modules.values()), modules)


def _read(file: Path) -> bytes:
    if not file.is_file():
        hint = " (only the safetensors format is read)" if file.name == WEIGHTS_FILE else ""
        raise ConfigError("lora_path", str(file.parent), f"no {file.name}{hint}")
    return file.read_bytes()


@dataclass(frozen=True, slots=True)
class _Config:
    lora_alpha: float
    use_rslora: bool


def _parse_config(folder: Path, raw: bytes) -> _Config:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("lora_path", str(folder), f"{CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError("lora_path", str(folder), f"{CONFIG_FILE} is not a JSON object")
    refusals = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for field, is_refused in refusals.items():
        if is_refused:
            raise ConfigError("lora_path", str(folder),
                              f"{CONFIG_FILE} sets {field}={config.get(field)!r}; only plain LoRA on "
                              f"{', '.join(TARGET_MODULES)} is served")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ConfigError("lora_path", str(folder), f"lora_alpha={alpha!r}: not a number")
    return _Config(float(alpha), bool(config.get("use_rslora", False)))


def _pair_modules(folder: Path, tensors: dict[str, torch.Tensor], config: _Config) -> dict[tuple[int, str], LoraModule]:
    """Match each module's lora_A with its lora_B and fold the scaling into B.

    The rank comes from the tensors (so PEFT's `rank_pattern` needs nothing more);
    scaling = alpha / r, or alpha / sqrt(r) with rsLoRA, as PEFT computes it."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if _MOE_TENSOR.search(name):
            raise ConfigError("lora_path", str(folder), f"tensor {name!r} adapts a mixture of experts' experts or "
                              "router, which are not LoRA targets (its attention projections are)")
        match = _TENSOR_NAME.search(name)
        if match is None:
            raise ConfigError("lora_path", str(folder), f"tensor {name!r} is not a LoRA weight of "
                              f"{', '.join(TARGET_MODULES)} (embedding and LM-head adapters are not served)")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        halves.setdefault((layer, module), {})[half] = tensor.float()
    modules = {}
    for key, pair in halves.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ConfigError("lora_path", str(folder), f"layer {key[0]} {key[1]}: lora_A and lora_B do not pair "
                              f"(shapes {_shape(a)} and {_shape(b)})")
        rank = a.shape[0]
        scaling = config.lora_alpha / (math.sqrt(rank) if config.use_rslora else rank)
        modules[key] = LoraModule(a, b * scaling, rank)
    return modules


def _shape(tensor: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(tensor.shape)
