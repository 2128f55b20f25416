"""What sets each served family apart, read from its `config.json` into `ModelConfig` fields.

`family_fields(arch, hf, head_dim)` gives the fields whose value depends on the family; an
option of a family that pdserve does not serve raises ConfigError naming it, never a silently
different model.
"""
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.rope_config import read_rope

LLAMA, QWEN2, MISTRAL = "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"
QWEN3, GEMMA3, PHI3 = "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"
QWEN3_MOE, MIXTRAL = "Qwen3MoeForCausalLM", "MixtralForCausalLM"
MIMO = "MiMoForCausalLM"  # Xiaomi MiMo: a Qwen2 body; its MTP layers draft (engine/spec/mtp.py)
SUPPORTED_ARCHITECTURES = (LLAMA, QWEN2, MISTRAL, QWEN3, GEMMA3, PHI3, QWEN3_MOE, MIXTRAL, MIMO)
_QWEN2_BODIES = (QWEN2, MIMO)
# Families whose window, when set, covers every layer; the Qwen families window only the layers
# from `max_window_layers` on, Gemma 3 all but every `sliding_window_pattern`-th.
_EVERY_LAYER_WINDOWED = (LLAMA, MISTRAL, PHI3, MIXTRAL)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture of experts' MLP: each token's `top_k` experts by the router's softmax, their
    weights renormalised to sum to 1 where `normalize_top_k` (Mixtral always; Qwen3-MoE by
    `norm_topk_prob`). Layers in `dense_layers` keep a dense MLP of `intermediate_size`."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool
    dense_layers: frozenset[int] = frozenset()


def family_fields(arch: str, hf: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    attention_bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = {
        "qkv_bias": arch in _QWEN2_BODIES or attention_bias,
        "o_bias": arch not in _QWEN2_BODIES and attention_bias,
        "activation": _activation(hf),
        **_windows(arch, hf),
    }
    if arch in (QWEN3, QWEN3_MOE, GEMMA3):
        fields["qk_norm"] = True
    if arch == GEMMA3:
        fields.update(_gemma3(hf, head_dim, fields))
    if arch == PHI3:
        fields["fused_projections"] = True
    if arch in (QWEN3_MOE, MIXTRAL):
        fields["moe"] = _moe(arch, hf)
    return fields


def _activation(hf: Mapping[str, Any]) -> str:
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if name not in _ACTIVATIONS:
        raise ConfigError("hidden_act", name, f"supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _windows(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """`sliding_window` and, where layers differ, `layer_windows`; a window no shorter than the
    context masks nothing and is dropped."""
    types = _layer_types(arch, hf)
    window = hf.get("sliding_window")
    if window is None or "sliding_attention" not in types:
        return {}
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window <= 0:
        raise ConfigError("sliding_window", window, "must be a positive integer or null")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention", True, "only causal attention is served")
    if window >= hf["max_position_embeddings"]:
        return {}
    layer_windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    if all(w is not None for w in layer_windows):
        return {"sliding_window": int(window)}
    return {"sliding_window": int(window), "layer_windows": layer_windows}


def _layer_types(arch: str, hf: Mapping[str, Any]) -> list[str]:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is not None:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if len(types) != layers or unknown:
            raise ConfigError("layer_types", types, f"one of sliding_attention, full_attention per layer ({layers})")
        return list(types)
    if arch in _EVERY_LAYER_WINDOWED:
        return ["sliding_attention"] * layers
    if arch == GEMMA3:
        pattern = int(hf.get("sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if not hf.get("use_sliding_window", False):
        return ["full_attention"] * layers
    first = int(hf.get("max_window_layers", layers))
    return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


def _gemma3(hf: Mapping[str, Any], head_dim: int, fields: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("attn_logit_softcapping") is not None:
        raise ConfigError("attn_logit_softcapping", hf["attn_logit_softcapping"],
                          "attention soft-capping is not served (Gemma 3 checkpoints leave it null)")
    cap = hf.get("final_logit_softcapping")
    local = read_rope(hf, head_dim, "sliding_attention") if "sliding_window" in fields else None
    return {
        "norm_offset": 1.0,
        "embed_scale": math.sqrt(int(hf["hidden_size"])),
        "sandwich_norms": True,
        "query_scale": float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        "final_logit_softcap": None if cap is None else float(cap),
        "local_rope": local,
    }


def _moe(arch: str, hf: Mapping[str, Any]) -> MoeConfig:
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts <= 0:
        raise ConfigError("num_local_experts", experts, "must be a positive integer")
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ConfigError("num_experts_per_tok", top_k, f"must be between 1 and num_local_experts={experts}")
    if arch == MIXTRAL:
        return MoeConfig(experts, top_k, int(hf["intermediate_size"]), True)
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError("shared_expert_intermediate_size", hf["shared_expert_intermediate_size"],
                          "shared experts are not served")
    step = int(hf.get("decoder_sparse_step", 1))
    dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
    dense |= {i for i in range(int(hf["num_hidden_layers"])) if step <= 0 or (i + 1) % step}
    return MoeConfig(experts, top_k, int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False)),
                     frozenset(dense))
