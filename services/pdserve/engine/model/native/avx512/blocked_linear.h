// Matrix products of a few rows (decode steps) read straight from oneDNN's packed weights.
//
// oneDNN packs a bf16 (N, K) matrix for AVX512-BF16 as blocks of 64 output columns, each
// holding its K inputs in pairs: element (n, k) sits at ((n / 64) * K/2 + k / 2) * 128 +
// (n % 64) * 2 + k % 2. `blocked_layout` checks that a packed matrix is laid out so (the layout
// is oneDNN's choice, per CPU and shape) before the model uses `blocked_linear` on it.
//
// Per pair of inputs, one 64-byte load holds 16 columns' weights and one broadcast a row's two
// inputs, so a tile of 6 rows x 64 columns keeps 24 accumulators in registers and reads each
// weight once per 6 rows (the block stays in L2 for the next 6). oneDNN reached 14 GB/s of
// weights on 1 row and 115 GFLOP/s on 10 (one core of a 2-core AMD EPYC, SmolLM2-135M's 121
// products); this kernel 27 GB/s and 167 GFLOP/s. Each output is one float32 sum over K in
// order, so a row's result does not depend on the other rows of the step.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <algorithm>

#include "vec.h"

namespace pdserve {

constexpr int64_t kBlockColumns = 64;  // output columns per packed block
constexpr int kTileRows = 6;           // rows per register tile: 6 x 4 accumulators

// The address of a packed (opaque oneDNN) tensor's data.
inline const bf16* packed_data(const at::Tensor& packed) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "");
  torch::jit::Stack stack{packed};
  op.callBoxed(&stack);
  return reinterpret_cast<const bf16*>(stack[0].toInt());
}

// True when `packed` holds `plain` (N, K) bf16 in the layout above: every element of the first,
// second and last rows of each block and of the first, second and last columns is where the
// layout puts it (a blocked K, padding or another block width would move some of them).
inline bool blocked_layout(const at::Tensor& packed, const at::Tensor& plain) {
#if defined(__AVX512BF16__)
  if (plain.scalar_type() != at::kBFloat16 || plain.dim() != 2 || packed.layout() == at::kStrided) return false;
  const int64_t N = plain.size(0), K = plain.size(1);
  if (N % kBlockColumns || K % 2) return false;
  static const c10::OperatorHandle nbytes = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "");
  torch::jit::Stack stack{packed};
  nbytes.callBoxed(&stack);
  if (stack[0].toInt() != N * K * 2) return false;
  const at::Tensor src = plain.contiguous();
  const uint16_t* p = reinterpret_cast<const uint16_t*>(src.data_ptr());
  const uint16_t* q = reinterpret_cast<const uint16_t*>(packed_data(packed));
  auto same = [&](int64_t n, int64_t k) {
    return q[((n / kBlockColumns) * (K / 2) + k / 2) * 2 * kBlockColumns + (n % kBlockColumns) * 2 + k % 2] ==
           p[n * K + k];
  };
  for (int64_t n = 0; n < N; ++n) {
    const int64_t in_block = n % kBlockColumns;
    if (in_block == 0 || in_block == 1 || in_block == kBlockColumns - 1) {
      for (int64_t k = 0; k < K; ++k)
        if (!same(n, k)) return false;
    } else if (!same(n, 0) || !same(n, 1) || !same(n, K - 1)) {
      return false;
    }
  }
  return true;
#else
  (void)packed, (void)plain;
  return false;  // the kernel needs AVX512-BF16's dot products
#endif
}

#if defined(__AVX512BF16__)
// y[r, c] = bf16(sum_k x[r, k] w[c, k] + bias[c] + residual[r, c]) for R rows and one block of
// 64 columns; `w` is the block, `c0` its first column, N the row stride of y and residual.
template <int R>
inline void blocked_tile(const bf16* x, int64_t K, const bf16* w, const bf16* bias, const bf16* residual,
                         int64_t c0, int64_t N, bf16* y) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < K / 2; ++pair) {
    const bf16* wp = w + pair * 2 * kBlockColumns;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, x + r * K + 2 * pair, 4);
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(two);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xr, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xr, w3);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + 16 * j;
      __m512 v = acc[r][j];
      if (bias) v = _mm512_add_ps(v, load16(bias + c));
      if (residual) v = _mm512_add_ps(v, load16(residual + r * N + c));
      store16(y + r * N + c, v);
    }
  }
}

template <int R = kTileRows>
inline void blocked_rows(int64_t rows, const bf16* x, int64_t K, const bf16* w, const bf16* bias,
                         const bf16* residual, int64_t c0, int64_t N, bf16* y) {
  if constexpr (R > 0) {
    if (rows == R) return blocked_tile<R>(x, K, w, bias, residual, c0, N, y);
    return blocked_rows<R - 1>(rows, x, K, w, bias, residual, c0, N, y);
  }
}
#endif

// x (M, K) bf16 . w^T + bias + residual with w (N, K) in the layout above at `w`; bias (N) and
// residual (M, N) bf16 or undefined, added before the one rounding (as oneDNN's fused add).
inline at::Tensor blocked_linear(const at::Tensor& x, const bf16* w, int64_t N, const at::Tensor& bias,
                                 const at::Tensor& residual) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && N % kBlockColumns == 0,
              "blocked_linear: contiguous bf16 rows and whole 64-column blocks");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const bf16* xs = reinterpret_cast<const bf16*>(x.data_ptr());
  const bf16* b = bias.defined() ? reinterpret_cast<const bf16*>(bias.data_ptr()) : nullptr;
  const bf16* res = residual.defined() ? reinterpret_cast<const bf16*>(residual.data_ptr()) : nullptr;
  bf16* ys = reinterpret_cast<bf16*>(y.data_ptr());
  at::parallel_for(0, N / kBlockColumns, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      const int64_t c0 = block * kBlockColumns;
      for (int64_t r0 = 0; r0 < M; r0 += kTileRows)
        blocked_rows(std::min<int64_t>(kTileRows, M - r0), xs + r0 * K, K, w + c0 * K, b,
                     res ? res + r0 * N : nullptr, c0, N, ys + r0 * N);
    }
  });
#else
  (void)w, (void)bias, (void)residual;
  TORCH_CHECK(false, "blocked_linear needs AVX512-BF16");
#endif
  return y;
}

}  // namespace pdserve
