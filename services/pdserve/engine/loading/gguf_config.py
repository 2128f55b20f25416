"""A GGUF file's metadata as the Hugging Face `config.json` of the same model.

Keys are under the file's architecture (`qwen3.embedding_length`). Where llama.cpp takes part
of a family's shape from fixed rules of its own rather than from the file, the same rules fill
the config when the file is silent (Gemma 3: every sixth layer global, a local rope base of
10000, the score scale from the model size). A key whose value pdserve does not serve raises
ConfigError naming the key.

Float32 values come back as the shortest decimal that rounds to them (1e-06, not
9.99999997e-07): the number the converter was given, so the config equals the checkpoint's.
What a GGUF never carries: the checkpoint's own dtype (its config says bfloat16, see
`torch_dtype` below), and a second end-of-sequence id (the file holds one).
"""
import math
from typing import Any, Callable

import numpy as np
import torch

from pdserve.common.errors import ConfigError
from pdserve.models.gguf_file import GgufFile, GgufValueType
from pdserve.engine.loading.dequant import dequantize, num_bytes
from pdserve.engine.loading.gguf_families import GgufFamily
from pdserve.engine.loading.rope_config import read_rope

_REQUIRED = object()
GEMMA3_LAYER_PATTERN = 6  # llama.cpp's: layer i is global where (i + 1) % 6 == 0
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's scores by hidden / heads, the others' by head_dim


class _Metadata:
    """A GGUF file's metadata, read by key under its architecture's prefix."""

    def __init__(self, gguf: GgufFile, arch: str) -> None:
        self.gguf, self.arch = gguf, arch

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def __call__(self, name: str, default: Any = _REQUIRED) -> Any:
        return read_value(self.gguf, self.key(name), default)

    def integer(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self(name, default)
        if value is not default and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(self.key(name), value, "must be one integer (per-layer values are not served)")
        return value


def read_value(gguf: GgufFile, key: str, default: Any = _REQUIRED) -> Any:
    """The value of `key`; ConfigError naming it when absent and there is no default."""
    if key not in gguf.metadata:
        if default is _REQUIRED:
            raise ConfigError(key, None, "missing from the GGUF metadata")
        return default
    value = gguf.metadata[key]
    return _decimal(value) if gguf.value_types[key] == GgufValueType.FLOAT32 else value


def hf_config(gguf: GgufFile, family: GgufFamily) -> dict[str, Any]:
    """The HF `config.json` dict of the model in `gguf`, a file of `family`."""
    meta = _Metadata(gguf, family.arch)
    config = _common(meta, family)
    config.update(_FAMILY_FIELDS[family.name](meta, config))
    return config


def _common(meta: _Metadata, family: GgufFamily) -> dict[str, Any]:
    hidden = meta.integer("embedding_length")
    num_heads = meta.integer("attention.head_count")
    head_dim = meta.integer("attention.key_length", hidden // num_heads)
    _check_head_dims(meta, head_dim)
    names = {t.name for t in meta.gguf.tensors}
    return {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": meta.integer("feed_forward_length"),
        "num_hidden_layers": meta.integer("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.integer("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta.integer("context_length"),
        "vocab_size": _vocab_size(meta),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(name.endswith("attn_q.bias") for name in names),
        "bos_token_id": read_value(meta.gguf, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": read_value(meta.gguf, "tokenizer.ggml.eos_token_id", None),
        # GGUF weights are mostly quantized and name no float dtype; `--dtype auto` serves them
        # in bfloat16 (half the memory of float32; native on CPUs with AVX-512 BF16 and on GPUs).
        "torch_dtype": "bfloat16",
    }


def _check_head_dims(meta: _Metadata, head_dim: int) -> None:
    for name in ("attention.value_length", "rope.dimension_count"):
        if meta.integer(name, head_dim) != head_dim:
            raise ConfigError(meta.key(name), meta(name), f"only {head_dim} (head_dim) is served")


def _vocab_size(meta: _Metadata) -> int:
    """The embedding's rows: the converter may drop rows past the tokenizer's (Gemma 3)."""
    embedding = next((t for t in meta.gguf.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ConfigError("tensor", "token_embd.weight", "missing from the GGUF file")
    rows = embedding.dims[-1]
    if meta.integer("vocab_size", rows) != rows:
        raise ConfigError(meta.key("vocab_size"), meta("vocab_size"), f"token_embd.weight has {rows} rows")
    return rows


def _rope_scaling(meta: _Metadata, served: tuple[str, ...]) -> str:
    kind = meta("rope.scaling.type", "none")
    if kind not in served:
        raise ConfigError(meta.key("rope.scaling.type"), kind, f"served for {meta.arch}: {', '.join(served)}")
    return kind


def _dense(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """Llama and Qwen3: the common fields say it all, with an unscaled rope."""
    _rope_scaling(meta, ("none",))
    return {}


def _mixtral(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    _rope_scaling(meta, ("none",))
    _check_routing(meta)
    return {"num_local_experts": meta.integer("expert_count"), "num_experts_per_tok": meta.integer("expert_used_count"),
            "intermediate_size": meta.integer("expert_feed_forward_length", config["intermediate_size"])}


def _qwen3_moe(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """Layers without a router keep a dense MLP (`mlp_only_layers`); llama.cpp's qwen3moe
    always renormalises the top-k weights unless the file says otherwise."""
    _rope_scaling(meta, ("none",))
    _check_routing(meta)
    names = {t.name for t in meta.gguf.tensors}
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return {"num_experts": meta.integer("expert_count"), "num_experts_per_tok": meta.integer("expert_used_count"),
            "moe_intermediate_size": meta.integer("expert_feed_forward_length"),
            "norm_topk_prob": bool(meta("expert_weights_norm", True)), "decoder_sparse_step": 1,
            "mlp_only_layers": dense}


def _check_routing(meta: _Metadata) -> None:
    """The router must be the served one: a softmax over routed experts only, unscaled."""
    if meta("expert_gating_func", 1) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ConfigError(meta.key("expert_gating_func"), meta("expert_gating_func"), "only softmax routing is served")
    if meta("expert_shared_count", 0):
        raise ConfigError(meta.key("expert_shared_count"), meta("expert_shared_count"), "shared experts are not served")
    if meta("expert_weights_scale", 1.0) != 1.0:
        raise ConfigError(meta.key("expert_weights_scale"), meta("expert_weights_scale"), "only 1.0 is served")


def _gemma3(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    if meta("attn_logit_softcapping", None) is not None:
        raise ConfigError(meta.key("attn_logit_softcapping"), meta("attn_logit_softcapping"),
                          "attention soft-capping is not served (Gemma 3 has none)")
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if _rope_scaling(meta, ("none", "linear")) == "linear":
        full |= {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    window = meta.integer("attention.sliding_window", None)
    return {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(meta, config),
        "sliding_window": window,
        "layer_types": _gemma3_layer_types(meta, config["num_hidden_layers"], window),
        "final_logit_softcapping": meta("final_logit_softcapping", None),
        "attn_logit_softcapping": None,
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": meta("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)}},
    }


def _query_pre_attn_scalar(meta: _Metadata, config: dict[str, Any]) -> float:
    """From `attention.scale` (the scale itself: scalar ** -0.5) where the file has it, else
    llama.cpp's rule. The checkpoints' scalars are integers, which float32 blurs: snapped back."""
    scale = meta("attention.scale", None)
    if scale is None:
        if config["num_hidden_layers"] == GEMMA3_27B_LAYERS:
            return config["hidden_size"] // config["num_attention_heads"]
        return config["head_dim"]
    scalar = scale ** -2
    return round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-6) else scalar


def _gemma3_layer_types(meta: _Metadata, num_layers: int, window: int | None) -> list[str]:
    """`attention.sliding_window_pattern`: every n-th layer global (llama.cpp: 0, all windowed),
    or one bool per layer (true: windowed); absent, llama.cpp's 6."""
    pattern = meta("attention.sliding_window_pattern", GEMMA3_LAYER_PATTERN)
    if window is None:
        windowed = [False] * num_layers
    elif isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ConfigError(meta.key("attention.sliding_window_pattern"), pattern, f"needs {num_layers} entries")
        windowed = [bool(p) for p in pattern]
    else:
        windowed = [pattern == 0 or (i + 1) % pattern != 0 for i in range(num_layers)]
    return ["sliding_attention" if w else "full_attention" for w in windowed]


def _phi3(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE where the file has its factor tensors; a window of 0 is none (Phi-4)."""
    kind = _rope_scaling(meta, ("none", "longrope"))
    original = meta.integer("rope.scaling.original_context_length", config["max_position_embeddings"])
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    fields = {"sliding_window": meta.integer("attention.sliding_window", 0) or None,
              "original_max_position_embeddings": original, "rope_parameters": rope}
    names = {t.name for t in meta.gguf.tensors}
    if "rope_factors_long.weight" not in names:
        if kind == "longrope":
            raise ConfigError("tensor", "rope_factors_long.weight", "missing from a longrope GGUF file")
        return fields
    rope |= {"rope_type": "longrope", "original_max_position_embeddings": original,
             "long_factor": _factors(meta.gguf, "rope_factors_long.weight"),
             "short_factor": _factors(meta.gguf, "rope_factors_short.weight")}
    attention = meta("rope.scaling.attn_factor", None)
    derived = read_rope({**config, **fields}, config["head_dim"]).scaling.attention_factor
    if attention is not None and not math.isclose(attention, derived, rel_tol=1e-6):
        rope["attention_factor"] = attention
    return fields


def _factors(gguf: GgufFile, name: str) -> list[float]:
    info = next((t for t in gguf.tensors if t.name == name), None)
    if info is None:
        raise ConfigError("tensor", name, "missing from the GGUF file")
    raw = np.frombuffer(gguf.data(info, num_bytes(info.ggml_type, info.dims)), dtype=np.uint8)
    values = dequantize(torch.from_numpy(raw), info.ggml_type, info.dims, torch.float32)
    return [_decimal(v) for v in values.tolist()]


def _decimal(value: float) -> float:
    """The shortest decimal that float32 rounds to `value`."""
    return float(str(np.float32(value)))


_FAMILY_FIELDS: dict[str, Callable[[_Metadata, dict[str, Any]], dict[str, Any]]] = {
    "llama": _dense, "mixtral": _mixtral, "qwen2": _dense, "qwen3": _dense, "qwen3moe": _qwen3_moe, "gemma3": _gemma3,
    "phi3": _phi3,
}
