// A decoder layer as the native model holds it, and as Python hands it over (native_forward.py).
#pragma once
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "activation.h"
#include "bf16.h"

namespace pdserve {

// One of the model's matrices as this level multiplies it.
struct Matrix {
  at::Tensor w;           // plain (N, K); oneDNN's packing (opaque); or panels (ceil(N / 16), K, 16)
  int64_t columns = 0;    // N
  const bf16* blocked = nullptr;  // oneDNN's packed bytes where `blocked_linear` may read them
};

// A decoder layer: its weights (undefined where the model has none: biases, the q/k norms of
// Qwen3 and Gemma 3, Gemma's norms of the attention's and the MLP's outputs) and how it attends.
struct Layer {
  at::Tensor input_norm, qkv_bias, q_norm, k_norm, o_bias, attn_out_norm, post_norm, gate_up_bias, down_bias,
      mlp_out_norm;
  Matrix qkv, o_proj, gate_up, down;
  int64_t window = 0;  // the keys a query sees, itself included (AttentionArgs: 0 for every key)
  int64_t rope = 0;    // its variant in the model's ropes
  Activation activation = Activation::kSilu;
};

// A layer as Python hands it over (native_forward.py): its 14 weight slots in the order the
// layer reads them (| input_norm | qkv | qkv_bias | q_norm | k_norm | o_proj | o_bias |
// attn_out_norm | post_norm | gate_up | gate_up_bias | down | down_bias | mlp_out_norm |, None
// where absent), its window (None: global), its rope's index and its activation's name.
using LayerSpec = std::tuple<std::vector<c10::optional<at::Tensor>>, c10::optional<int64_t>, int64_t, std::string>;
constexpr size_t kLayerSlots = 14;
// A rope variant: inv_freq, LongRoPE's long_inv_freq (or None), long_from, attention_factor.
using RopeSpec = std::tuple<at::Tensor, c10::optional<at::Tensor>, int64_t, double>;

}  // namespace pdserve
