// Rotary embeddings on the native path: one `Rope` per variant a model's layers use
// (`CausalLM.ropes`: Gemma 3's window layers have their own base), its cos and sin tables built
// once per step from the step's positions, each layer reading its variant's.
#pragma once
#include <torch/extension.h>

#include <utility>

namespace pdserve {

struct Rope {
  at::Tensor inv_freq;       // (hd/2,) float32
  at::Tensor long_inv_freq;  // LongRoPE (Phi-3): the frequencies of positions >= long_from; else undefined
  int64_t long_from = 0;
  double attention_factor = 1.0;  // LongRoPE: cos and sin are multiplied by it
};

// positions (T,) int64 -> (cos, signed sin), each (T, hd) in `dtype`: op for op what
// `RotaryEmbedding.cos_sin` (layers.py) computes, so both paths rotate by the same bits.
inline std::pair<at::Tensor, at::Tensor> cos_sin(const Rope& rope, const at::Tensor& positions, at::ScalarType dtype) {
  const at::Tensor p = positions.to(at::kFloat);
  at::Tensor angles = at::outer(p, rope.inv_freq);  // (T, hd/2)
  if (rope.long_inv_freq.defined())
    angles = at::where(positions.ge(rope.long_from).unsqueeze(1), at::outer(p, rope.long_inv_freq), angles);
  at::Tensor cos = angles.cos(), sin = angles.sin();
  if (rope.attention_factor != 1.0) {
    cos = cos * rope.attention_factor;
    sin = sin * rope.attention_factor;
  }
  return {at::cat({cos, cos}, -1).to(dtype).contiguous(), at::cat({-sin, sin}, -1).to(dtype).contiguous()};
}

}  // namespace pdserve
