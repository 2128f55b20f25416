"""Per-token building blocks of the decoder: RMSNorm, rotary embedding, the gated MLP (SwiGLU, GeGLU).

Everything here works on flattened tokens `(T, ...)`: the tokens of every sequence in a
step side by side, so one matmul serves the whole batch.
"""
import math

import torch
import torch.nn.functional as F

from pdserve.engine.loading.rope_config import Llama3RopeScaling, LinearRopeScaling, LongRopeScaling, Rope
from pdserve.engine.model.lora import DOWN, GATE_UP, NO_LORA, LoraStep


class RMSNorm:
    __slots__ = ("weight", "eps")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight  # (H,)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H)."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inverse_frequencies(rope: Rope, head_dim: int, long: bool = False) -> torch.Tensor:
    """(head_dim // 2,) float32 angular frequencies, scaled as `rope` says (LongRoPE: its short
    factors, or its long ones with `long`)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    s = rope.scaling
    if isinstance(s, LongRopeScaling):
        factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta ** exponents)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if isinstance(s, LinearRopeScaling):
        return inv_freq / s.factor
    if isinstance(s, Llama3RopeScaling):
        return _llama3_scaled(inv_freq, s)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Stretch long wavelengths by `factor`, keep short ones, blend linearly in between."""
    wavelength = 2 * math.pi / inv_freq
    original = s.original_max_position_embeddings
    # 0 where the wavelength is long (fully stretched), 1 where it is short (kept as is).
    blend = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blend = blend.clamp(0.0, 1.0)
    return (1 - blend) * (inv_freq / s.factor) + blend * inv_freq


class RotaryEmbedding:
    """Rotates query and key heads by their absolute position (half-split layout).

    LongRoPE (Phi-3) has a second set of frequencies, `long_inv_freq`, for positions from
    `long_from` on, and multiplies cos and sin by `attention_factor`. (Transformers picks one set
    for a whole forward by its longest position; here each position takes its own, so a
    sequence's cached keys never change meaning as it grows past `long_from`.)"""

    __slots__ = ("inv_freq", "long_inv_freq", "long_from", "attention_factor")

    def __init__(self, rope: Rope, head_dim: int, device: torch.device) -> None:
        self.inv_freq = rope_inverse_frequencies(rope, head_dim).to(device)  # (hd/2,)
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from, self.attention_factor = 0, 1.0
        if isinstance(rope.scaling, LongRopeScaling):
            self.long_inv_freq = rope_inverse_frequencies(rope, head_dim, long=True).to(device)
            self.long_from = rope.scaling.original_max_position_embeddings
            self.attention_factor = rope.scaling.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> (cos, signed sin), each (T, 1, hd) in `dtype`; once per step.

        The sin table is negated on its first half, so `apply` needs only a swap of halves."""
        angles = torch.outer(positions.float(), self.inv_freq)  # (T, hd/2)
        if self.long_inv_freq is not None:
            long = torch.outer(positions.float(), self.long_inv_freq)
            angles = torch.where((positions >= self.long_from).unsqueeze(1), long, angles)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos_full = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos_full, signed_sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x (T, n, hd) -> rotated (T, n, hd): x*cos + [x2, x1]*[-sin, sin], a new tensor."""
        first, second = x.chunk(2, dim=-1)  # (T, n, hd/2) each
        return x * cos + torch.cat((second, first), dim=-1) * signed_sin


class GatedMLP:
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; `activation` is silu
    (SwiGLU) or gelu_tanh (GeGLU, Gemma)."""

    __slots__ = ("gate_up", "gate_up_bias", "down", "down_bias", "activation")

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 activation: str = "silu") -> None:
        self.activation = activation
        self.gate_up = gate_up  # (2I, H)
        self.gate_up_bias = gate_up_bias  # (2I,) or None
        self.down = down  # (H, I)
        self.down_bias = down_bias  # (H,) or None

    def __call__(self, x: torch.Tensor, lora: LoraStep = NO_LORA, layer: int = 0) -> torch.Tensor:
        """(T, H) -> (T, H); `lora` adds the adapters' deltas of decoder layer `layer`."""
        gate_up = lora.add(F.linear(x, self.gate_up, self.gate_up_bias), x, layer, GATE_UP)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
        hidden = (F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        return lora.add(F.linear(hidden, self.down, self.down_bias), hidden, layer, DOWN)
