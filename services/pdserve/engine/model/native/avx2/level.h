// What model.cpp calls at the AVX2 level (AVX2, FMA, F16C: x86-64-v3): this folder's kernels,
// and for what only the AVX-512 levels have (oneDNN's bf16 packing read in place, AMX tiles),
// answers that keep model.cpp on its other paths.
#pragma once
#include <torch/extension.h>

#include "attention.h"
#include "elementwise.h"
#include "panel_linear.h"

namespace pdserve {

constexpr const char* kLevel = "avx2";

// Every chunk reads the paged KV in place, in float32 too: one path for every row keeps a
// prompt's bits the same whole, chunked or behind a cached prefix.
constexpr bool kFlashFloatPrompts = false;

// oneDNN packs no bf16 weights for these CPUs (the model's bf16 matrices are panels here).
inline bool blocked_layout(const at::Tensor&, const at::Tensor&) { return false; }
inline const bf16* packed_data(const at::Tensor&) { return nullptr; }
inline at::Tensor blocked_linear(const at::Tensor&, const bf16*, int64_t, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "blocked_linear is an AVX512-BF16 kernel");
}
constexpr int64_t kBlockColumns = 64;

inline bool use_amx_attention(bool) { return false; }  // no AMX at this level

}  // namespace pdserve
