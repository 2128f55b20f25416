"""Per-token building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SwiGLU MLP.

Everything here works on flattened tokens `(T, ...)`: the tokens of every sequence in a
step side by side, so one matmul serves the whole batch.
"""
import math

import torch
import torch.nn.functional as F

from pdserve.engine.loading.model_config import Llama3RopeScaling, ModelConfig
from pdserve.engine.model.lora import DOWN, GATE_UP, NO_LORA, LoraStep


class RMSNorm:
    __slots__ = ("weight", "eps")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight  # (H,)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H)."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """(head_dim // 2,) float32 angular frequencies, Llama-3 scaled when configured."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is None:
        return inv_freq
    return _llama3_scaled(inv_freq, config.rope_scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Stretch long wavelengths by `factor`, keep short ones, blend linearly in between."""
    wavelength = 2 * math.pi / inv_freq
    original = s.original_max_position_embeddings
    # 0 where the wavelength is long (fully stretched), 1 where it is short (kept as is).
    blend = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blend = blend.clamp(0.0, 1.0)
    return (1 - blend) * (inv_freq / s.factor) + blend * inv_freq


class RotaryEmbedding:
    """Rotates query and key heads by their absolute position (half-split layout)."""

    __slots__ = ("inv_freq",)

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = rope_inverse_frequencies(config).to(device)  # (hd/2,)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> (cos, signed sin), each (T, 1, hd) in `dtype`; once per step.

        The sin table is negated on its first half, so `apply` needs only a swap of halves."""
        angles = torch.outer(positions.float(), self.inv_freq)  # (T, hd/2)
        cos, sin = angles.cos(), angles.sin()
        cos_full = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos_full, signed_sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x (T, n, hd) -> rotated (T, n, hd): x*cos + [x2, x1]*[-sin, sin], a new tensor."""
        first, second = x.chunk(2, dim=-1)  # (T, n, hd/2) each
        return x * cos + torch.cat((second, first), dim=-1) * signed_sin


class SwiGLU:
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    __slots__ = ("gate_up", "gate_up_bias", "down", "down_bias")

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> None:
        self.gate_up = gate_up  # (2I, H)
        self.gate_up_bias = gate_up_bias  # (2I,) or None
        self.down = down  # (H, I)
        self.down_bias = down_bias  # (H,) or None

    def __call__(self, x: torch.Tensor, lora: LoraStep = NO_LORA, layer: int = 0) -> torch.Tensor:
        """(T, H) -> (T, H); `lora` adds the adapters' deltas of decoder layer `layer`."""
        gate_up = lora.add(F.linear(x, self.gate_up, self.gate_up_bias), x, layer, GATE_UP)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
        hidden = F.silu(gate) * up
        return lora.add(F.linear(hidden, self.down, self.down_bias), hidden, layer, DOWN)
