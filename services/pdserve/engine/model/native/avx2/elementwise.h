// Per-token kernels of a decoder layer on AVX2, 8 lanes at a time (widths are multiples of 16; the
// caller checks): the AVX-512 level's kernels at half the width. Each rounds where the torch ops
// it replaces round, so the native path computes what `engine/layers.py` computes, in one pass
// over memory instead of several.
#pragma once
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "../activation.h"
#include "../head_norms.h"
#include "vec.h"

namespace pdserve {

// 1 / sqrt(mean(x^2) + eps) over a row of H, in every lane.
template <typename T>
inline __m256 inverse_rms(const T* x, int64_t H, float eps) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) squares = _mm256_fmadd_ps(load8(x + i), load8(x + i), squares);
  return _mm256_set1_ps(1.0f / std::sqrt(sum8(squares) / float(H) + eps));
}

// One row of H: out = (x * rsqrt(mean(x^2) + eps) rounded to T) * weight (as F.rms_norm and HF);
// out may be x.
template <typename T>
inline void norm_row(const T* x, int64_t H, const T* weight, float eps, T* out) {
  const __m256 inv = inverse_rms(x, H, eps);
  for (int64_t i = 0; i < H; i += 8)
    store8(out + i, _mm256_mul_ps(round8<T>(_mm256_mul_ps(load8(x + i), inv)), load8(weight + i)));
}

// norm_row over rows of H.
template <typename T>
void rms_norm(const T* x, int64_t rows, int64_t H, const T* weight, float eps, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) norm_row(x + r * H, H, weight, eps, out + r * H);
  });
}

// out = residual + rms_norm(x), the norm rounded to T before the add, in one pass (Gemma's
// norms of a sublayer's output: `h + norm(out)` in decoder.py).
template <typename T>
void rms_norm_add(const T* x, int64_t rows, int64_t H, const T* weight, float eps, const T* residual, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * H;
      const __m256 inv = inverse_rms(xr, H, eps);
      for (int64_t i = 0; i < H; i += 8) {
        const __m256 y = _mm256_mul_ps(round8<T>(_mm256_mul_ps(load8(xr + i), inv)), load8(weight + i));
        store8(out + r * H + i, _mm256_add_ps(load8(residual + r * H + i), round8<T>(y)));
      }
    }
  });
}

// One row: out (I) = act(gate) * up, gate and up the two halves of gate_up (2I): gate * sigmoid(z)
// (../activation.h), the activation fixed at compile time (no test in the loop).
template <Activation A, typename T>
inline void gated_row(const T* gate_up, int64_t I, T* out) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < I; i += 8) {
    const __m256 g = load8(gate_up + i);
    __m256 z = g;
    if constexpr (A == Activation::kGeluTanh) {
      const __m256 cubed = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluTanhCubic), g), _mm256_mul_ps(g, g));
      z = _mm256_mul_ps(_mm256_set1_ps(kGeluTanhScale), _mm256_add_ps(g, cubed));
    }
    const __m256 a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, z))));
    store8(out + i, _mm256_mul_ps(round8<T>(a), load8(gate_up + I + i)));
  }
}

// gate_up (rows, 2I) = [gate | up] -> out (rows, I) = act(gate) * up, rounded as
// F.silu(gate) * up (or F.gelu(gate, approximate="tanh") * up) rounds.
template <typename T>
void gated_activation(const T* gate_up, int64_t rows, int64_t I, Activation act, T* out) {
  at::parallel_for(0, rows, 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      if (act == Activation::kGeluTanh)
        gated_row<Activation::kGeluTanh>(gate_up + r * 2 * I, I, out + r * I);
      else
        gated_row<Activation::kSilu>(gate_up + r * 2 * I, I, out + r * I);
    }
  });
}

// Rotates the q and k heads of each token's qkv row in place (half-split layout; cos and sin
// tables (T, hd) in T, sin negated on its first half, as layers.py builds them), then stores
// k and v into the paged KV tensor at the token's layer-0 row shifted to `layer`. Where `norms`
// has weights (Qwen3, Gemma 3), each q and k head is RMS-normed (norm_row) before its rotation.
template <typename T>
void rope_and_store(T* qkv, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t hd, const T* cos,
                    const T* sin, T* kv_token_rows, int64_t layer, int64_t tokens_per_block,
                    const int64_t* token_rows, const HeadNorms<T>& norms = {}) {
  const int64_t width = (num_heads + 2 * num_kv_heads) * hd, half = hd / 2, row_elems = num_kv_heads * hd;
  at::parallel_for(0, tokens, 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      T* row = qkv + t * width;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        T* head = row + h * hd;
        if (norms.q) norm_row(head, hd, h < num_heads ? norms.q : norms.k, norms.eps, head);
        for (int64_t d = 0; d < half; d += 8) {
          const __m256 x1 = load8(head + d), x2 = load8(head + half + d);
          const T* c = cos + t * hd + d;
          const T* s = sin + t * hd + d;
          store8(head + d, _mm256_add_ps(round8<T>(_mm256_mul_ps(x1, load8(c))),
                                         round8<T>(_mm256_mul_ps(x2, load8(s)))));
          store8(head + half + d, _mm256_add_ps(round8<T>(_mm256_mul_ps(x2, load8(c + half))),
                                                round8<T>(_mm256_mul_ps(x1, load8(s + half)))));
        }
      }
      T* k_dst = kv_token_rows + (token_rows[t] + 2 * layer * tokens_per_block) * row_elems;
      T* v_dst = kv_token_rows + (token_rows[t] + (2 * layer + 1) * tokens_per_block) * row_elems;
      std::memcpy(k_dst, row + num_heads * hd, row_elems * sizeof(T));
      std::memcpy(v_dst, row + (num_heads + num_kv_heads) * hd, row_elems * sizeof(T));
    }
  });
}

}  // namespace pdserve
