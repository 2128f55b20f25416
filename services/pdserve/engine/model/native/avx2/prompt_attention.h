// Attention for tiles of prompt rows on AVX2, as small matrix products in float (the AVX2
// counterpart of the AVX-512 levels' packed tile kernels). Per KV head and chunk of keys
// (`Avx2Attention` stages the chunk's K and V rows as floats), with the item's rows transposed
// once into Q^T (head dimension by row, 16 rows to a pair of vectors):
//
//   S^T (keys x rows) = K . Q^T         6 keys x 16 rows per register tile (`score_tile`)
//   softmax down each row's column, 8 rows at a time (one online-softmax step per chunk)
//   O (rows x hd) = O * corr + P . V    6 rows x 16 dimensions per register tile (`value_tile`)
//
// Each tile product is 12 FMAs to 2 loads and 6 broadcasts, where the per-row path spends a
// horizontal sum per 8 scores. A row's arithmetic depends only on its query, its position and
// the keys it sees: every prompt row goes through here however few a chunk holds (as at the
// AVX-512 levels), so a prompt comes out the same bits whole, chunked or behind a cached prefix.
// The register tiles are functions of their own with named sums (see panel_linear.h for why).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace pdserve {

#define PDSERVE_TILE_SUMS                                                                                        \
  const __m256 zero = _mm256_setzero_ps();                                                                       \
  __m256 a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero, a30 = zero, a31 = zero,           \
         a40 = zero, a41 = zero, a50 = zero, a51 = zero;
#define PDSERVE_TILE_FOR_EACH(X) X(0) X(1) X(2) X(3) X(4) X(5)

// s rows i < R (keys k + i, stride hd) = their dot products with the 16 rows of qt (hd, stride
// `width`) starting there; s has row stride `width`.
template <int R>
__attribute__((noinline)) void score_tile(const float* k, int64_t hd, const float* qt, int64_t width, float* s) {
  PDSERVE_TILE_SUMS
  for (int64_t d = 0; d < hd; ++d) {
    const __m256 q0 = _mm256_loadu_ps(qt + d * width), q1 = _mm256_loadu_ps(qt + d * width + 8);
#define PDSERVE_SCORE(i)                                      \
    if constexpr (R > i) {                                    \
      const __m256 kd = _mm256_broadcast_ss(k + i * hd + d);  \
      a##i##0 = _mm256_fmadd_ps(kd, q0, a##i##0);             \
      a##i##1 = _mm256_fmadd_ps(kd, q1, a##i##1);             \
    }
    PDSERVE_TILE_FOR_EACH(PDSERVE_SCORE)
#undef PDSERVE_SCORE
  }
#define PDSERVE_STORE_SCORE(i)                         \
  if constexpr (R > i) {                               \
    _mm256_storeu_ps(s + i * width, a##i##0);          \
    _mm256_storeu_ps(s + i * width + 8, a##i##1);      \
  }
  PDSERVE_TILE_FOR_EACH(PDSERVE_STORE_SCORE)
#undef PDSERVE_STORE_SCORE
}

// o rows i < R (stride hd, 16 dimensions from o) = o * corr[i] + sum over keys j < n of
// pt[j * width + i] * v[j * hd ..] (the same 16 dimensions of V's row j).
template <int R>
__attribute__((noinline)) void value_tile(const float* pt, int64_t width, int64_t n, const float* v, int64_t hd,
                                          const float* corr, float* o) {
  PDSERVE_TILE_SUMS
#define PDSERVE_LOAD_SUMS(i)                                                   \
  if constexpr (R > i) {                                                       \
    const __m256 c = _mm256_broadcast_ss(corr + i);                            \
    a##i##0 = _mm256_mul_ps(_mm256_loadu_ps(o + i * hd), c);                   \
    a##i##1 = _mm256_mul_ps(_mm256_loadu_ps(o + i * hd + 8), c);               \
  }
  PDSERVE_TILE_FOR_EACH(PDSERVE_LOAD_SUMS)
#undef PDSERVE_LOAD_SUMS
  for (int64_t j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * hd), v1 = _mm256_loadu_ps(v + j * hd + 8);
#define PDSERVE_WEIGH(i)                                        \
    if constexpr (R > i) {                                      \
      const __m256 p = _mm256_broadcast_ss(pt + j * width + i); \
      a##i##0 = _mm256_fmadd_ps(p, v0, a##i##0);                \
      a##i##1 = _mm256_fmadd_ps(p, v1, a##i##1);                \
    }
    PDSERVE_TILE_FOR_EACH(PDSERVE_WEIGH)
#undef PDSERVE_WEIGH
  }
#define PDSERVE_STORE_SUMS(i)                          \
  if constexpr (R > i) {                               \
    _mm256_storeu_ps(o + i * hd, a##i##0);             \
    _mm256_storeu_ps(o + i * hd + 8, a##i##1);         \
  }
  PDSERVE_TILE_FOR_EACH(PDSERVE_STORE_SUMS)
#undef PDSERVE_STORE_SUMS
}
#undef PDSERVE_TILE_SUMS
#undef PDSERVE_TILE_FOR_EACH

template <int R = 6>
inline void score_tiles(int64_t keys, const float* k, int64_t hd, const float* qt, int64_t width, float* s) {
  if constexpr (R > 0) {
    if (keys == R) return score_tile<R>(k, hd, qt, width, s);
    return score_tiles<R - 1>(keys, k, hd, qt, width, s);
  }
}

template <int R = 6>
inline void value_tiles(int64_t rows, const float* pt, int64_t width, int64_t n, const float* v, int64_t hd,
                        const float* corr, float* o) {
  if constexpr (R > 0) {
    if (rows == R) return value_tile<R>(pt, width, n, v, hd, corr, o);
    return value_tiles<R - 1>(rows, pt, width, n, v, hd, corr, o);
  }
}

// The item's rows through the chunks of keys one KV head sees: queries q (rows, hd) and
// positions pos (rows) given; O, m, l kept here across chunks.
struct PromptTile {
  int64_t hd = 0, rows = 0, width = 0;  // width: rows rounded up to 16
  float scale = 1.0f;
  int64_t window = 0;
  std::vector<float> qt, st, o, m, l, corr;  // qt (hd, width); st (chunk keys, width); o (rows, hd)
  std::vector<int32_t> pos;                  // (width); -1 past the rows: such a column sees no key

  void start(const float* q, const int64_t* positions, int64_t num_rows, int64_t head_dim, float scale_,
             int64_t window_, int64_t max_keys) {
    hd = head_dim, rows = num_rows, width = (num_rows + 15) / 16 * 16, scale = scale_, window = window_;
    qt.assign(hd * width, 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < hd; ++d) qt[d * width + r] = q[r * hd + d];
    st.resize(max_keys * width);
    o.assign(rows * hd, 0.0f);
    m.assign(width, -std::numeric_limits<float>::infinity());
    l.assign(width, 0.0f);
    corr.resize(width);
    pos.assign(width, -1);
    for (int64_t r = 0; r < rows; ++r) pos[r] = int32_t(positions[r]);
  }

  // Keys key .. key + n - 1, their K and V rows as floats in k and v (stride hd).
  void attend(const float* k, const float* v, int64_t key, int64_t n) {
    for (int64_t c = 0; c < width; c += 16)
      for (int64_t j = 0; j < n; j += 6)
        score_tiles(std::min<int64_t>(6, n - j), k + j * hd, hd, qt.data() + c, width, st.data() + j * width + c);
    for (int64_t c = 0; c < width; c += 8) softmax_step(c, key, n);
    for (int64_t r = 0; r < rows; r += 6)
      for (int64_t d = 0; d < hd; d += 16)
        value_tiles(std::min<int64_t>(6, rows - r), st.data() + r, width, n, v + d, hd, corr.data() + r,
                    o.data() + r * hd + d);
  }

  // Columns c .. c + 7 of S^T: scaled, masked to the keys each row sees, one online-softmax step
  // (their running maximum and sum, and corr: what their earlier sums are scaled by); S^T then
  // holds the probabilities (0 where a row may not look).
  void softmax_step(int64_t c, int64_t key, int64_t n) {
    const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), scale_v = _mm256_set1_ps(scale);
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&pos[c]));
    const __m256i oldest = _mm256_sub_epi32(p, _mm256_set1_epi32(int32_t(window)));
    auto seen = [&](int64_t j) {  // lanes whose row sees key + j
      const __m256i at = _mm256_set1_epi32(int32_t(key + j));
      __m256i ok = _mm256_xor_si256(_mm256_cmpgt_epi32(at, p), _mm256_set1_epi32(-1));  // key <= pos
      if (window) ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(at, oldest));
      return _mm256_castsi256_ps(ok);
    };
    __m256 top = minus_inf;
    for (int64_t j = 0; j < n; ++j) {
      float* sj = &st[j * width + c];
      const __m256 x = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(_mm256_loadu_ps(sj), scale_v), seen(j));
      _mm256_storeu_ps(sj, x);
      top = _mm256_max_ps(top, x);
    }
    const __m256 old_max = _mm256_loadu_ps(&m[c]), new_max = _mm256_max_ps(old_max, top);
    const __m256 was_empty = _mm256_cmp_ps(old_max, minus_inf, _CMP_EQ_OQ);
    const __m256 c_v = _mm256_andnot_ps(was_empty, exp8(_mm256_sub_ps(old_max, new_max)));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      float* sj = &st[j * width + c];
      const __m256 prob = _mm256_and_ps(seen(j), exp8(_mm256_sub_ps(_mm256_loadu_ps(sj), new_max)));
      sum = _mm256_add_ps(sum, prob);
      _mm256_storeu_ps(sj, prob);
    }
    _mm256_storeu_ps(&l[c], _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(&l[c]), c_v), sum));
    _mm256_storeu_ps(&m[c], new_max);
    _mm256_storeu_ps(&corr[c], c_v);
  }
};

}  // namespace pdserve
