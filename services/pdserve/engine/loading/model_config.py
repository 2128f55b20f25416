"""The model's shape, read once from a Hugging Face `config.json` dict.

One decoder serves every family; a family is a set of switches on it (`family_config`):
Llama, Qwen2 (bias on q/k/v), Mistral (a sliding window), Qwen3 (per-head q/k norms), Gemma 3
(interleaved window and global layers, GeGLU, sandwich norms, scaled embeddings), Phi-3 (fused
projections, LongRoPE) and the mixtures of experts Mixtral and Qwen3-MoE. Anything else, or an
option of a family that is not served, raises `ConfigError` naming the field.
"""
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.family_config import SUPPORTED_ARCHITECTURES, MoeConfig, family_fields
from pdserve.engine.loading.rope_config import Llama3RopeScaling, Rope, RopeScaling, read_rope

__all__ = ["SUPPORTED_ARCHITECTURES", "Llama3RopeScaling", "ModelConfig", "MoeConfig", "Rope"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # keys older than this many positions are masked (window layers)
    torch_dtype: str | None = None  # the checkpoint's own dtype name, if it says
    # Per layer: its window (None: global). Empty: `sliding_window` on every layer.
    layer_windows: tuple[int | None, ...] = ()
    local_rope: Rope | None = None  # the window layers' own rope (Gemma 3), else the model's
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (offset + w) (Gemma: 1)
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # norms after attention and the MLP too, before each residual (Gemma)
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    fused_projections: bool = False  # the checkpoint stores qkv_proj and gate_up_proj (Phi-3)
    moe: MoeConfig | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, None where it attends to every key."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def rope_of(self, layer: int) -> Rope:
        if self.local_rope is not None and self.window_of(layer) is not None:
            return self.local_rope
        return Rope(self.rope_theta, self.rope_scaling)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed `config.json`. Raises ConfigError for what we cannot serve."""
        arch = _architecture(hf)
        hidden = _positive_int(hf, "hidden_size")
        num_heads = _positive_int(hf, "num_attention_heads")
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ConfigError("num_key_value_heads", num_kv_heads,
                              f"must divide num_attention_heads={num_heads}")
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        rope = read_rope(hf, head_dim, "full_attention")
        return cls(
            architecture=arch,
            vocab_size=_positive_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(hf, "intermediate_size"),
            num_layers=_positive_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=_positive_int(hf, "max_position_embeddings"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            **family_fields(arch, hf, head_dim),
        )


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError("architectures", archs,
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _positive_int(hf: Mapping[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ConfigError(key, value, "must be a positive integer")
    return int(value)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
