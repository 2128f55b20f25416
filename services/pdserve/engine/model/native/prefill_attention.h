// Attention for tiles of many query tokens in bf16, as small matrix products on AVX512-BF16:
// per KV head and chunk of 32 keys, K and V are packed once per query tile (up to 128 tokens) into bf16 pairs
// (K by head dimension, V by key), then each query row costs hd/2 dot-product instructions for its 16
// scores and 8 * hd/16 for its output, shared by the query heads of the group. Probabilities
// go through bf16 for P.V, as in torch's flash attention on bf16 inputs.
#pragma once
#if defined(__AVX512BF16__)
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace pdserve {

template <int CH>
struct Bf16TileAttention {
  static constexpr int64_t HD = CH * 16;
  static constexpr int64_t kKeys = 32;  // keys per chunk: two vectors of scores
  const bf16* kv;  // the KV tensor shifted to this layer's K: block b's K rows at kv + b * block_stride
  int64_t key_stride, kind_stride;
  float scale;
  int64_t window;
  int64_t block_stride;
  std::vector<uint32_t> kp, vp;  // (HD/2, 32) K pairs by dimension; (16, HD) V pairs by key
  std::vector<float> acc, m, l;  // per row of the tile: output sums, running max, running sum

  Bf16TileAttention(const bf16* layer_kv, int64_t block_stride_, int64_t key_stride_, int64_t kind_stride_,
                    float scale_, int64_t window_)
      : kv(layer_kv), key_stride(key_stride_), kind_stride(kind_stride_), scale(scale_), window(window_),
        block_stride(block_stride_) {}


  // Rows of one KV head: row r's query vector at q_rows[r], its position positions[r]; keys
  // first_key..last_key through `table`. Writes float outputs (rows, HD) to out_rows.
  void run(const bf16* const* q_rows, const int64_t* positions, int64_t rows, const int32_t* table,
           int64_t tpb, int64_t first_key, int64_t last_key, int64_t kv_head, float* out_rows) {
    acc.assign(rows * HD, 0.0f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    kp.resize(HD / 2 * kKeys);
    vp.resize(kKeys / 2 * HD);
    for (int64_t key = first_key - first_key % kKeys; key <= last_key; key += kKeys) {
      const int64_t n = std::min<int64_t>(kKeys, last_key + 1 - key);
      pack(table, tpb, key, n, kv_head);
      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows) attend_rows<kRows>(r, q_rows + r, positions + r, key, n);
      for (; r < rows; ++r) attend_rows<1>(r, q_rows + r, positions + r, key, n);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t d = 0; d < HD; ++d) out_rows[r * HD + d] = acc[r * HD + d] * inv;
    }
  }

  void pack(const int32_t* table, int64_t tpb, int64_t key, int64_t n, int64_t kv_head) {
    std::fill(kp.begin(), kp.end(), 0u);
    std::fill(vp.begin(), vp.end(), 0u);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = key + j;
      const bf16* k = kv + int64_t(table[pos / tpb]) * block_stride + (pos % tpb) * key_stride + kv_head * HD;
      const bf16* v = k + kind_stride;
      uint32_t kpair[HD / 2];
      std::memcpy(kpair, k, HD * sizeof(bf16));
      for (int64_t dp = 0; dp < HD / 2; ++dp) kp[dp * kKeys + j] = kpair[dp];
      uint16_t* vdst = reinterpret_cast<uint16_t*>(&vp[(j / 2) * HD]) + (j % 2);
      for (int64_t d = 0; d < HD; ++d) vdst[2 * d] = v[d].bits;
    }
  }

  // Rows r .. r + NR through one chunk together: each K and V pair vector is loaded once for all
  // of them and their dependent chains (max, exp, sums) interleave. A row's arithmetic is the same
  // whatever NR; when a row sees none of the chunk, each row goes through alone.
  static constexpr int kRows = CH <= 4 ? 4 : CH <= 8 ? 2 : 1;
  template <int NR>
  void attend_rows(int64_t r, const bf16* const* q, const int64_t* pos, int64_t key, int64_t n) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < NR; ++i)
      if (pos[i] < key || (window && key + n - 1 <= pos[i] - window)) {
        if constexpr (NR > 1)
          for (int k = 0; k < NR; ++k) attend_rows<1>(r + k, q + k, pos + k, key, n);
        return;
      }
    __m512 lo[NR], hi[NR];
    {
      __m512 s_lo[NR], s_hi[NR], t_lo[NR], t_hi[NR];
      for (int i = 0; i < NR; ++i) s_lo[i] = s_hi[i] = t_lo[i] = t_hi[i] = _mm512_setzero_ps();
      for (int64_t dp = 0; dp < HD / 2; dp += 2) {
        const __m512bh k0l = (__m512bh)_mm512_loadu_si512(&kp[dp * kKeys]);
        const __m512bh k0h = (__m512bh)_mm512_loadu_si512(&kp[dp * kKeys + 16]);
        const __m512bh k1l = (__m512bh)_mm512_loadu_si512(&kp[(dp + 1) * kKeys]);
        const __m512bh k1h = (__m512bh)_mm512_loadu_si512(&kp[(dp + 1) * kKeys + 16]);
        for (int i = 0; i < NR; ++i) {
          const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q[i]);
          const __m512bh q0 = (__m512bh)_mm512_set1_epi32(int(q32[dp])), q1 = (__m512bh)_mm512_set1_epi32(int(q32[dp + 1]));
          s_lo[i] = _mm512_dpbf16_ps(s_lo[i], q0, k0l);
          s_hi[i] = _mm512_dpbf16_ps(s_hi[i], q0, k0h);
          t_lo[i] = _mm512_dpbf16_ps(t_lo[i], q1, k1l);
          t_hi[i] = _mm512_dpbf16_ps(t_hi[i], q1, k1h);
        }
      }
      const __m512 scale_v = _mm512_set1_ps(scale);
      for (int i = 0; i < NR; ++i) {
        lo[i] = _mm512_mul_ps(_mm512_add_ps(s_lo[i], t_lo[i]), scale_v);
        hi[i] = _mm512_mul_ps(_mm512_add_ps(s_hi[i], t_hi[i]), scale_v);
      }
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pos_lo = _mm512_add_epi32(_mm512_set1_epi32(int(key)), iota);
    const __m512i pos_hi = _mm512_add_epi32(pos_lo, _mm512_set1_epi32(16));
    const uint32_t in_chunk = uint32_t((1ull << n) - 1);
    __mmask16 valid_lo[NR], valid_hi[NR];
    for (int i = 0; i < NR; ++i) {
      const __m512i query = _mm512_set1_epi32(int(pos[i]));
      valid_lo[i] = _mm512_cmple_epi32_mask(pos_lo, query) & __mmask16(in_chunk);
      valid_hi[i] = _mm512_cmple_epi32_mask(pos_hi, query) & __mmask16(in_chunk >> 16);
      if (window) {
        const __m512i oldest = _mm512_set1_epi32(int(pos[i] - window));
        valid_lo[i] &= _mm512_cmpgt_epi32_mask(pos_lo, oldest);
        valid_hi[i] &= _mm512_cmpgt_epi32_mask(pos_hi, oldest);
      }
      if (!valid_lo[i] && !valid_hi[i]) {
        if constexpr (NR > 1)
          for (int k = 0; k < NR; ++k) attend_rows<1>(r + k, q + k, pos + k, key, n);
        return;
      }
    }
    uint32_t ppair[NR][16];
    __m512 correction[NR];
    for (int i = 0; i < NR; ++i) {
      const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), valid_lo[i], lo[i]);
      const __m512 y = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), valid_hi[i], hi[i]);
      const float new_max = std::max(m[r + i], _mm512_reduce_max_ps(_mm512_max_ps(x, y)));
      const __m512 top = _mm512_set1_ps(new_max);
      const __m512 p_lo = exp16(_mm512_sub_ps(x, top)), p_hi = exp16(_mm512_sub_ps(y, top));
      correction[i] = exp16(_mm512_set1_ps(m[r + i] - new_max));  // 0 when m was -inf
      l[r + i] = l[r + i] * _mm512_cvtss_f32(correction[i]) + _mm512_reduce_add_ps(_mm512_add_ps(p_lo, p_hi));
      m[r + i] = new_max;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ppair[i]), (__m256i)_mm512_cvtneps_pbh(p_lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ppair[i] + 8), (__m256i)_mm512_cvtneps_pbh(p_hi));
    }
    __m512 out[NR][CH];
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < CH; ++c) out[i][c] = _mm512_mul_ps(_mm512_loadu_ps(&acc[(r + i) * HD + 16 * c]), correction[i]);
    for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
      __m512bh v[CH];
      for (int c = 0; c < CH; ++c) v[c] = (__m512bh)_mm512_loadu_si512(&vp[jp * HD + 16 * c]);
      for (int i = 0; i < NR; ++i) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(int(ppair[i][jp]));
        for (int c = 0; c < CH; ++c) out[i][c] = _mm512_dpbf16_ps(out[i][c], pj, v[c]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(&acc[(r + i) * HD + 16 * c], out[i][c]);
  }
};

}  // namespace pdserve
#endif
