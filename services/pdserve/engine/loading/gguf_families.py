"""Each GGUF architecture pdserve reads, in Hugging Face terms: its HF architecture and the HF
name of each of its llama.cpp tensors.

llama.cpp names a tensor by its role (`blk.3.ffn_norm`); what that role is called in an HF
checkpoint depends on the family (Gemma 3's `ffn_norm` is its pre-feedforward norm; Phi-3's
`ffn_up` holds gate and up fused, as its `gate_up_proj`). A family also says how its files
differ from the HF checkpoint's tensors, as llama.cpp's convert_hf_to_gguf.py writes them:
  - Q/K rows interleaved per head, for llama.cpp's `llama` arch only (Llama, Mixtral);
    qwen2, qwen3, qwen3moe, gemma3 and phi3 keep HF's row order;
  - norm weights stored as 1 + w (Gemma: HF's RMSNorm scales by 1 + w, llama.cpp's by w);
  - experts stacked into one (num_experts, rows, cols) tensor per projection (Mixtral, Qwen3-MoE);
  - Phi-3's LongRoPE factors stored as tensors (they belong in the config).
Mixtral is llama.cpp's `llama` arch with `llama.expert_count` set.
"""
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from pdserve.common.errors import ConfigError

_ATTENTION = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_POST_ATTENTION_NORM = {"ffn_norm": "post_attention_layernorm"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class GgufFamily:
    name: str  # the GGUF architecture, or "mixtral" (a `llama` file with experts)
    arch: str  # `general.architecture`: the prefix of the file's own metadata keys
    hf_architecture: str
    model_type: str
    layer_tensors: Mapping[str, str]  # llama.cpp part -> HF name after `model.layers.N.`
    expert_tensors: Mapping[str, str] = field(default_factory=dict)  # stacked part -> HF name with {expert}
    config_tensors: frozenset[str] = frozenset()  # read into the config, not weights
    is_rope_permuted: bool = False  # Q/K rows in llama.cpp's interleaved order
    norm_shift: float = 0.0  # a stored norm weight is norm_shift + the HF weight


@dataclass(frozen=True, slots=True)
class HfTarget:
    """Where a GGUF tensor goes: one HF tensor, or, for a stack of experts, one per expert
    (`name` then has an `{expert}` field for the expert's index)."""

    name: str
    is_expert_stack: bool = False


LLAMA = GgufFamily("llama", "llama", "LlamaForCausalLM", "llama",
                   {**_ATTENTION, **_POST_ATTENTION_NORM, **_DENSE_MLP}, is_rope_permuted=True)
MIXTRAL = GgufFamily(
    "mixtral", "llama", "MixtralForCausalLM", "mixtral",
    {**_ATTENTION, **_POST_ATTENTION_NORM, "ffn_gate_inp": "block_sparse_moe.gate"},
    {"ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1", "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
     "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3"},
    is_rope_permuted=True)
# Qwen2's q/k/v biases come under the same parts (`attn_q.bias`)
QWEN2 = GgufFamily("qwen2", "qwen2", "Qwen2ForCausalLM", "qwen2", {**_ATTENTION, **_POST_ATTENTION_NORM, **_DENSE_MLP})
QWEN3 = GgufFamily("qwen3", "qwen3", "Qwen3ForCausalLM", "qwen3",
                   {**_ATTENTION, **_QK_NORMS, **_POST_ATTENTION_NORM, **_DENSE_MLP})
# Layers without a router (`mlp_only_layers`) keep a dense MLP under the dense names.
QWEN3_MOE = GgufFamily(
    "qwen3moe", "qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe",
    {**_ATTENTION, **_QK_NORMS, **_POST_ATTENTION_NORM, **_DENSE_MLP, "ffn_gate_inp": "mlp.gate"},
    {"ffn_gate_exps": "mlp.experts.{expert}.gate_proj", "ffn_up_exps": "mlp.experts.{expert}.up_proj",
     "ffn_down_exps": "mlp.experts.{expert}.down_proj"})
GEMMA3 = GgufFamily(
    "gemma3", "gemma3", "Gemma3ForCausalLM", "gemma3_text",
    {**_ATTENTION, **_QK_NORMS, **_DENSE_MLP, "post_attention_norm": "post_attention_layernorm",
     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    norm_shift=1.0)
PHI3 = GgufFamily(
    "phi3", "phi3", "Phi3ForCausalLM", "phi3",
    {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
     **_POST_ATTENTION_NORM, "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}))
_BY_ARCH = {family.arch: family for family in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, GEMMA3, PHI3)}


def family_of(metadata: Mapping[str, Any]) -> GgufFamily:
    """The family of a file with this metadata; ConfigError naming `general.architecture` if none."""
    arch = metadata.get("general.architecture")
    if arch == "llama" and metadata.get("llama.expert_count"):
        return MIXTRAL
    if arch not in _BY_ARCH:
        raise ConfigError("general.architecture", arch, f"supported GGUF architectures: {', '.join(_BY_ARCH)}")
    return _BY_ARCH[arch]


def hf_target(family: GgufFamily, gguf_name: str) -> HfTarget:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ConfigError if the
    family has no such tensor."""
    if match := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in family.layer_tensors:
            return HfTarget(f"model.layers.{layer}.{family.layer_tensors[part]}.{kind}")
        if part in family.expert_tensors:
            return HfTarget(f"model.layers.{layer}.{family.expert_tensors[part]}.{kind}", is_expert_stack=True)
    elif match := _GLOBAL_NAME.fullmatch(gguf_name):
        part, kind = match.groups()
        if part in _GLOBAL_TENSORS:
            return HfTarget(f"{_GLOBAL_TENSORS[part]}.{kind}")
    raise ConfigError("tensor", gguf_name, f"not a {family.name} tensor this loader maps to a Hugging Face name")
