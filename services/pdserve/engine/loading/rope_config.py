"""Rotary-embedding settings read from a Hugging Face config: the base and its scaling.

Both the older `rope_theta` / `rope_scaling` keys and the newer `rope_parameters` block are
accepted; Gemma 3 gives one block per layer type (`full_attention`, `sliding_attention`).
Scalings served: Llama 3's frequency-dependent stretch, linear, and Phi-3's LongRoPE.
"""
import math
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.common.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope")


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3 frequency-dependent rope scaling (long wavelengths stretched by `factor`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LinearRopeScaling:
    """Every frequency divided by `factor` (Gemma 3's global layers in its larger sizes)."""

    factor: float


@dataclass(frozen=True, slots=True)
class LongRopeScaling:
    """Phi-3's LongRoPE: each frequency divided by its own factor, `short_factor` for positions
    below `original_max_position_embeddings` and `long_factor` from there on; cos and sin are
    multiplied by `attention_factor`."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling | LongRopeScaling


@dataclass(frozen=True, slots=True)
class Rope:
    theta: float
    scaling: RopeScaling | None = None


def read_rope(hf: Mapping[str, Any], head_dim: int, layer_type: str | None = None) -> Rope:
    """The rope of `layer_type`'s layers (None: the model's one rope)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if layer_type is not None and isinstance(params.get(layer_type), Mapping):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
        # Gemma 3's older spelling: the window layers' own base, unscaled (the scaling is the global layers')
        return Rope(float(hf["rope_local_base_freq"]))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError("partial_rotary_factor", params.get("partial_rotary_factor", hf.get("partial_rotary_factor")),
                          "partial rotary embeddings are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError("rope_scaling.rope_type", rope_type, f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return Rope(theta)
    try:
        if rope_type == "linear":
            return Rope(theta, LinearRopeScaling(float(params["factor"])))
        if rope_type == "longrope":
            return Rope(theta, _longrope(hf, params, head_dim))
        return Rope(theta, _llama3(params))
    except KeyError as missing:
        raise ConfigError(f"rope_scaling.{missing.args[0]}", None, f"required for {rope_type}") from None


def _llama3(params: Mapping[str, Any]) -> Llama3RopeScaling:
    scaling = Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError("rope_scaling.high_freq_factor", scaling.high_freq_factor, "must exceed low_freq_factor")
    return scaling


def _longrope(hf: Mapping[str, Any], params: Mapping[str, Any], head_dim: int) -> LongRopeScaling:
    """As transformers computes it: the attention factor, unless given, from the ratio of the
    model's context to the original one."""
    original = int(params.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
    short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if len(factors) != head_dim // 2:
            raise ConfigError(f"rope_scaling.{name}", len(factors), f"must have head_dim / 2 = {head_dim // 2} entries")
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(short, long, original, float(attention))
