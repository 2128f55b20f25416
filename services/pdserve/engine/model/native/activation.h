// The gated MLP's activations, the same at every ISA level: act(gate) * up, where act is
//
//   silu       gate * sigmoid(gate)                                  (SwiGLU: Llama, Qwen, Phi-3)
//   gelu_tanh  0.5 gate (1 + tanh(u)), u = sqrt(2 / pi) (gate + 0.044715 gate^3)   (GeGLU: Gemma)
//
// Both are gate * sigmoid(z), since 0.5 (1 + tanh(u)) = sigmoid(2u): z = gate, or z = 2u. The
// levels' kernels compute that one form (no tanh, and no cancellation near 0).
#pragma once
#include <string>

#include <c10/util/Exception.h>

namespace pdserve {

enum class Activation { kSilu, kGeluTanh };

// layers.py's name of an activation (`GatedMLP.activation`).
inline Activation activation_named(const std::string& name) {
  if (name == "silu") return Activation::kSilu;
  TORCH_CHECK(name == "gelu_tanh", "no native activation ", name, " (silu, gelu_tanh)");
  return Activation::kGeluTanh;
}

constexpr float kGeluTanhScale = 1.5957691216057308f;  // 2 sqrt(2 / pi): z = 2u
constexpr float kGeluTanhCubic = 0.044715f;

}  // namespace pdserve
