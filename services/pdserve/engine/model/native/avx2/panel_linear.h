// Matrix products over weights packed once, at load, into panels of 16 output columns, for CPUs
// with AVX2 + FMA: in bf16 (oneDNN packs no bf16 weights there and torch's bf16 products run a
// slow generic path; the weights are widened to float in registers) and in float32 (against
// `at::linear`'s 0.4x the speed at one row and a result that depends on the row count).
//
// Panel p holds columns 16p .. 16p + 15 (zeros past N) for every input k in turn. bf16: each
// input's 16 weights as 8 pairs (column 16p + j, column 16p + 8 + j), so one 32-byte load gives
// 16 weights, a shift the first 8 columns as floats and a mask the other 8; float32: the 16 in
// order, two loads. A tile of 6 rows x 16 columns keeps 12 accumulators in registers and reads
// each weight once per 6 rows. The rows are widened to float once per call, 6 at a time
// interleaved by input (`pack_rows`: a tile's 6 inputs k sit side by side), and taken in blocks
// that stay in L2 while every panel of a thread passes over them. Each output is one float sum
// over K in order (then bias, then residual, then one rounding), so a row's result does not
// depend on the other rows of the step, and a step of one row reads the weights at the memory's
// pace.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "vec.h"

namespace pdserve {

constexpr int64_t kPanelColumns = 16;
constexpr int kPanelRows = 6;            // rows per register tile: 6 x 2 accumulators
constexpr int64_t kPrefetchBytes = 1024;  // of a panel, asked for ahead of the step that reads them

// w (N, K) bf16 or float32 -> panels (ceil(N / 16), K, 16) in the layout above.
inline at::Tensor to_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "to_panels: a (N, K) bf16 or float32 matrix");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanelColumns - 1) / kPanelColumns;
  at::Tensor padded = w.contiguous();
  if (N % kPanelColumns) padded = at::cat({padded, at::zeros({panels * kPanelColumns - N, K}, w.options())});
  if (w.scalar_type() == at::kFloat)  // [p][c][k] -> [p][k][c]
    return padded.view({panels, kPanelColumns, K}).permute({0, 2, 1}).contiguous();
  // [p][h][j][k] -> [p][k][j][h]: column 16p + 8h + j, input k
  return padded.view({panels, 2, 8, K}).permute({0, 3, 2, 1}).contiguous().view({panels, K, kPanelColumns});
}

inline bool is_panels(const at::Tensor& w) {
  return w.defined() && w.dim() == 3 && w.size(2) == kPanelColumns &&
         (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat);
}

// Input k's 16 weights of a panel as floats: (columns 0-7, columns 8-15).
inline void panel_weights(const bf16* row, __m256i high, __m256& lo, __m256& hi) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(w, high));
}
inline void panel_weights(const float* row, __m256i, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(row);
  hi = _mm256_loadu_ps(row + 8);
}

// acc[r] = row r of a packed tile . the panel's 16 columns, as (columns 0-7, columns 8-15). The
// 12 sums, two weight vectors, a row's input and the mask take all 16 registers, so the kernel
// is a function of its own (inlined into its caller, GCC kept the mask and spilled a sum instead,
// a store and a reload at every step: 0.5x the speed), and the sums are named variables (held in
// an array, GCC also stored every one to the stack at every step).
template <int R, typename W>
__attribute__((noinline)) void panel_tile(const float* tile, int64_t K, const W* panel,
                                          __m256 (&acc)[kPanelRows][2]) {
  static_assert(R >= 1 && R <= kPanelRows);
  constexpr int64_t line_steps = 64 / (kPanelColumns * sizeof(W)), ahead = kPrefetchBytes / (kPanelColumns * sizeof(W));
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  for (int64_t k = 0; k < K; ++k) {
    if (k % line_steps == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + ahead) * kPanelColumns), _MM_HINT_T0);
    __m256 lo, hi;
    panel_weights(panel + k * kPanelColumns, high, lo, hi);
    const float* xk = tile + k * kPanelRows;
#define PDSERVE_PANEL_ROW(r)                          \
    if constexpr (R > r) {                            \
      const __m256 xr = _mm256_broadcast_ss(xk + r);  \
      a##r##0 = _mm256_fmadd_ps(xr, lo, a##r##0);     \
      a##r##1 = _mm256_fmadd_ps(xr, hi, a##r##1);     \
    }
    PDSERVE_PANEL_ROW(0) PDSERVE_PANEL_ROW(1) PDSERVE_PANEL_ROW(2)
    PDSERVE_PANEL_ROW(3) PDSERVE_PANEL_ROW(4) PDSERVE_PANEL_ROW(5)
#undef PDSERVE_PANEL_ROW
  }
  const __m256 sums[kPanelRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) acc[r][0] = sums[r][0], acc[r][1] = sums[r][1];
}

template <typename W, int R = kPanelRows>
inline void panel_rows(int64_t rows, const float* tile, int64_t K, const W* panel, __m256 (&acc)[kPanelRows][2]) {
  if constexpr (R > 0) {
    if (rows == R) return panel_tile<R>(tile, K, panel, acc);
    return panel_rows<W, R - 1>(rows, tile, K, panel, acc);
  }
}

// x (M, K) in T -> float tiles (ceil(M / 6), K, 6): tile t's input k holds rows 6t .. 6t + 5
// (zero past M) side by side.
template <typename T>
at::Tensor pack_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), tiles = (M + kPanelRows - 1) / kPanelRows;
  at::Tensor packed = at::empty({tiles, K, kPanelRows}, x.options().dtype(at::kFloat));
  const T* xs = reinterpret_cast<const T*>(x.data_ptr());
  float* out = packed.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      for (int r = 0; r < kPanelRows; ++r) {
        const int64_t row = t * kPanelRows + r;
        float* dst = out + t * K * kPanelRows + r;
        if (row >= M) {
          for (int64_t k = 0; k < K; ++k) dst[k * kPanelRows] = 0.0f;
          continue;
        }
        for (int64_t k = 0; k < K; ++k) dst[k * kPanelRows] = to_float(xs[row * K + k]);
      }
  });
  return packed;
}

// y rows r0 .. r0 + rows of panel p's columns c0 .. c0 + width: sums + bias + residual, rounded once.
template <typename T>
void store_tile(const __m256 (&acc)[kPanelRows][2], int64_t rows, int64_t r0, int64_t c0, int64_t width, int64_t N,
                const T* bias, const T* residual, T* y) {
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = y + (r0 + r) * N + c0;
    const T* res_row = residual ? residual + (r0 + r) * N + c0 : nullptr;
    if (width == kPanelColumns) {
      for (int h = 0; h < 2; ++h) {
        __m256 v = acc[r][h];
        if (bias) v = _mm256_add_ps(v, load8(bias + c0 + 8 * h));
        if (res_row) v = _mm256_add_ps(v, load8(res_row + 8 * h));
        store8(dst + 8 * h, v);
      }
      continue;
    }
    alignas(32) float sums[kPanelColumns];  // the last, narrower panel: column by column
    _mm256_store_ps(sums, acc[r][0]);
    _mm256_store_ps(sums + 8, acc[r][1]);
    for (int64_t c = 0; c < width; ++c) {
      float v = sums[c];
      if (bias) v += to_float(bias[c0 + c]);
      if (res_row) v += to_float(res_row[c]);
      dst[c] = from_float<T>(v);
    }
  }
}

constexpr int64_t kRowBlockBytes = 192 << 10;  // packed rows kept in L2 while a thread's panels pass


template <typename T>
void panel_products(const at::Tensor& x, const at::Tensor& panels, int64_t N, const T* bias, const T* residual,
                    T* y) {
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0);
  const at::Tensor tiles = pack_rows<T>(x);
  const float* xs = tiles.data_ptr<float>();
  const T* w = reinterpret_cast<const T*>(panels.data_ptr());
  const int64_t num_tiles = tiles.size(0);
  const int64_t block = std::max<int64_t>(1, kRowBlockBytes / (K * kPanelRows * int64_t(sizeof(float))));
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
    __m256 acc[kPanelRows][2];
    for (int64_t t0 = 0; t0 < num_tiles; t0 += block) {
      for (int64_t p = first; p < last; ++p) {
        const int64_t c0 = p * kPanelColumns, width = std::min(kPanelColumns, N - c0);
        for (int64_t t = t0; t < std::min(num_tiles, t0 + block); ++t) {
          const int64_t r0 = t * kPanelRows, rows = std::min<int64_t>(kPanelRows, M - r0);
          panel_rows<T>(rows, xs + t * K * kPanelRows, K, w + p * K * kPanelColumns, acc);
          store_tile<T>(acc, rows, r0, c0, width, N, bias, residual, y);
        }
      }
    }
  });
}

// y (M, N) = x (M, K) . w^T + bias + residual in the panels' dtype (bf16 or float32), w as panels;
// bias (N) and residual (M, N) or undefined, added before the one rounding.
inline at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const at::Tensor& bias,
                               const at::Tensor& residual) {
  const auto dtype = panels.scalar_type();
  TORCH_CHECK(is_panels(panels) && x.scalar_type() == dtype && x.dim() == 2 && x.size(1) == panels.size(1),
              "panel_linear: rows of the panels' K inputs, in their dtype");
  TORCH_CHECK(N > (panels.size(0) - 1) * kPanelColumns && N <= panels.size(0) * kPanelColumns,
              "panel_linear: ", N, " columns do not fill ", panels.size(0), " panels");
  const int64_t M = x.size(0);
  const at::Tensor bias_c = bias.defined() ? bias.contiguous() : bias;
  const at::Tensor residual_c = residual.defined() ? residual.contiguous() : residual;
  TORCH_CHECK(!bias_c.defined() || (bias_c.scalar_type() == dtype && bias_c.numel() == N), "bias: (N,) in x's dtype");
  TORCH_CHECK(!residual_c.defined() || (residual_c.scalar_type() == dtype && residual_c.numel() == M * N),
              "residual: (M, N) in x's dtype");
  at::Tensor y = at::empty({M, N}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto ptr = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr; };
    panel_products<T>(x.contiguous(), panels, N, ptr(bias_c), ptr(residual_c), reinterpret_cast<T*>(y.data_ptr()));
  };
  if (dtype == at::kBFloat16) run(bf16{}); else run(float{});
  return y;
}

}  // namespace pdserve
