"""The model's shape, read once from a Hugging Face `config.json` dict.

Three architectures share one forward: Llama, Qwen2 (bias on the q/k/v projections)
and Mistral (optional sliding window). Anything else raises `ConfigError` naming it.
Both the older `rope_theta` / `rope_scaling` keys and the newer `rope_parameters`
block are accepted.
"""
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.common.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3 frequency-dependent rope scaling (long wavelengths stretched by `factor`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: Llama3RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # keys older than this many positions are masked
    torch_dtype: str | None = None  # the checkpoint's own dtype name, if it says

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError("hidden_act", hf.get("hidden_act"), "only silu is supported")
        theta, scaling = _rope(hf)
        is_qwen = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=_positive_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(hf, "intermediate_size"),
            num_layers=_positive_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=_positive_int(hf, "max_position_embeddings"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
            qkv_bias=is_qwen or bool(hf.get("attention_bias", False)),
            o_bias=not is_qwen and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=_sliding_window(hf, arch),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
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


def _rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling) from either `rope_parameters` or `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError("rope_scaling.rope_type", rope_type,
                          f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ConfigError(f"rope_scaling.{missing.args[0]}", None, "required for llama3") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError("rope_scaling.high_freq_factor", scaling.high_freq_factor,
                          "must exceed low_freq_factor")
    return theta, scaling


def _sliding_window(hf: Mapping[str, Any], arch: str) -> int | None:
    """Mistral's window applies to every layer; Qwen2's per-layer windows are not served."""
    window = hf.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        if hf.get("use_sliding_window", False):
            raise ConfigError("use_sliding_window", True, "Qwen2 sliding-window layers are not supported")
        return None
    if window is None:
        return None
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window <= 0:
        raise ConfigError("sliding_window", window, "must be a positive integer or null")
    return int(window) if window < hf["max_position_embeddings"] else None
