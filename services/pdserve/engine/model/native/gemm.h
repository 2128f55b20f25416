// Small-M bf16 matrix product on AVX512-BF16: y (M, N) = x (M, K) . w (N, K)^T, float
// accumulation. Decode steps have few rows, so the weights stream through once while each
// 4-row panel of w is reused from L1 for every row of x; the read bandwidth is the limit.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>

#include "vec.h"

namespace pdserve {

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;

inline __m512bh load_bf16x32(const bf16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}
inline __m512bh load_bf16x32(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
}

// dots[i][j] = x row i . w row j, for MR rows of x and NR rows of w.
template <int MR, int NR>
inline void dot_tile(const bf16* x, int64_t ldx, const bf16* w, int64_t K, float dots[MR][NR]) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_bf16x32(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      __m512bh xv = load_bf16x32(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {
    __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_bf16x32(w + j * K + k, mask);
    for (int i = 0; i < MR; ++i) {
      __m512bh xv = load_bf16x32(x + i * ldx + k, mask);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) dots[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

struct GemmArgs {
  const bf16* x;
  int64_t M, K;
  const bf16* w;
  int64_t N;
  const bf16* bias;      // (N,) or nullptr
  const bf16* residual;  // (M, N) or nullptr: y = bf16(bf16(x.w + bias) + residual)
  bf16* y;               // (M, N)
};

template <int MR, int NR>
inline void gemm_tile(const GemmArgs& a, int64_t m, int64_t n) {
  float dots[MR][NR];
  dot_tile<MR, NR>(a.x + m * a.K, a.K, a.w + n * a.K, a.K, dots);
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float v = dots[i][j] + (a.bias ? to_float(a.bias[n + j]) : 0.0f);
      if (a.residual) v = rounded<bf16>(v) + to_float(a.residual[(m + i) * a.N + n + j]);
      a.y[(m + i) * a.N + n + j] = to_bf16(v);
    }
  }
}

template <int NR>
inline void gemm_columns(const GemmArgs& a, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) gemm_tile<4, NR>(a, m, n);
  for (; m < a.M; ++m) gemm_tile<1, NR>(a, m, n);
}

inline void gemm_bf16(const GemmArgs& a) {
  constexpr int64_t kBlock = 16;  // rows of w per task
  const int64_t num_blocks = (a.N + kBlock - 1) / kBlock;
  at::parallel_for(0, num_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t end = std::min(a.N, (b + 1) * kBlock);
      int64_t n = b * kBlock;
      for (; n + 4 <= end; n += 4) gemm_columns<4>(a, n);
      for (; n < end; ++n) gemm_columns<1>(a, n);
    }
  });
}
#else
constexpr bool kHasBf16Dot = false;
struct GemmArgs {
  const bf16* x;
  int64_t M, K;
  const bf16* w;
  int64_t N;
  const bf16* bias;
  const bf16* residual;
  bf16* y;
};
inline void gemm_bf16(const GemmArgs&) {}
#endif

}  // namespace pdserve
