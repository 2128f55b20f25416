// Attention for tiles of many query tokens in bf16, as small matrix products on AVX512-BF16:
// per KV head and block of 128 keys, K and V are packed once per query tile (up to 128 tokens) into
// bf16 pairs (K by head dimension, V by key). A row's scores for the block go to a buffer first,
// then its softmax takes one maximum and rescales its outputs once per block (an online softmax
// over 32-key chunks spent ~30 % of the kernel there), in powers of two with a short exp2. Each
// query row costs hd/2 dot-product instructions per 16 scores and 8 * hd/16 per 16 keys of output,
// shared by the query heads of the group. Probabilities go through bf16 for P.V, as in torch's
// flash attention on bf16 inputs. Blocks start at multiples of 128 positions, so a row's
// arithmetic is the same however its prompt was split into chunks or tiles.
#pragma once
#if defined(__AVX512BF16__)
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace pdserve {

// 2^x as 2^n * 2^f, n the nearest integer to x and |f| <= 1/2, 2^f by the polynomial whose
// coefficients `c` are listed from the highest degree down.
template <size_t N>
inline __m512 exp2_by(__m512 x, const float (&c)[N]) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0, 2^f by its degree-6 Taylor polynomial (relative error under 1e-6 down to
// 2^-24, 4e-6 near float's smallest): ten instructions against exp16's seventeen. x is raised
// to -160 first, where the result is already 0: -inf would make f NaN, and scalef of a NaN is
// NaN by Intel's rules.
inline __m512 exp2_nonpositive(__m512 x) {
  static constexpr float taylor6[] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                      5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};
  return exp2_by(_mm512_max_ps(x, _mm512_set1_ps(-160.0f)), taylor6);
}

template <int CH>
struct Bf16TileAttention {
  static constexpr int64_t HD = CH * 16;
  static constexpr int64_t kChunk = 32;   // keys per two vectors of scores
  static constexpr int64_t kBlock = 128;  // keys per softmax block
  static constexpr int kRows = CH <= 4 ? 4 : CH <= 8 ? 2 : 1;  // rows that share each K and V load
  const bf16* kv;  // the KV tensor shifted to this layer's K: block b's K rows at kv + b * block_stride
  int64_t key_stride, kind_stride;
  float scale;  // times log2 e: scores, maxima and probabilities in powers of two
  int64_t window;
  int64_t block_stride;
  std::vector<uint32_t> kp, vp;  // (HD/2, kBlock) K pairs by dimension; (kBlock/2, HD) V pairs by key
  std::vector<float> acc, m, l;  // per row of the tile: output sums, running max, running sum
  alignas(64) float scores[kRows][kBlock];
  alignas(64) uint32_t probs[kRows][kBlock / 2];  // bf16 pairs by key

  Bf16TileAttention(const bf16* layer_kv, int64_t block_stride_, int64_t key_stride_, int64_t kind_stride_,
                    float scale_, int64_t window_)
      : kv(layer_kv), key_stride(key_stride_), kind_stride(kind_stride_), scale(scale_ * 1.44269504088896341f),
        window(window_), block_stride(block_stride_) {}

  // Rows of one KV head: row r's query vector at q_rows[r], its position positions[r]; keys
  // first_key..last_key through `table`. Writes float outputs (rows, HD) to out_rows.
  void run(const bf16* const* q_rows, const int64_t* positions, int64_t rows, const int32_t* table,
           int64_t tpb, int64_t first_key, int64_t last_key, int64_t kv_head, float* out_rows) {
    acc.assign(rows * HD, 0.0f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    kp.resize(HD / 2 * kBlock);
    vp.resize(kBlock / 2 * HD);
    for (int64_t key = first_key - first_key % kBlock; key <= last_key; key += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, last_key + 1 - key);
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

  // Keys key .. key + n - 1; the rest of the last chunk is zero (its scores are masked, and a
  // zero probability times a zero V row adds nothing). K: 16 keys' pairs at a time, transposed
  // 16 x 16; V: two keys' rows interleaved.
  void pack(const int32_t* table, int64_t tpb, int64_t key, int64_t n, int64_t kv_head) {
    const int64_t padded = (n + kChunk - 1) / kChunk * kChunk;
    auto k_row = [&](int64_t j) {
      const int64_t pos = key + j;
      return kv + int64_t(table[pos / tpb]) * block_stride + (pos % tpb) * key_stride + kv_head * HD;
    };
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
      const bf16* rows[16];
      for (int i = 0; i < 16; ++i) rows[i] = j0 + i < n ? k_row(j0 + i) : nullptr;
      for (int64_t t = 0; t < HD / 32; ++t) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + 32 * t) : _mm512_setzero_si512();
        transpose16x16(r);
        for (int c = 0; c < 16; ++c) _mm512_storeu_si512(&kp[(16 * t + c) * kBlock + j0], r[c]);
      }
    }
    const __m512i first = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006,
                                            0x270007, 0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d,
                                            0x2e000e, 0x2f000f);  // a[d] then b[d], d = 0 .. 15
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < padded; j += 2) {
      const bf16* a = j < n ? k_row(j) + kind_stride : nullptr;
      const bf16* b = j + 1 < n ? k_row(j + 1) + kind_stride : nullptr;
      uint16_t* dst = reinterpret_cast<uint16_t*>(&vp[(j / 2) * HD]);
      for (int64_t c = 0; c < HD / 32; ++c) {
        const __m512i x = a ? _mm512_loadu_si512(a + 32 * c) : _mm512_setzero_si512();
        const __m512i y = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 64 * c, _mm512_permutex2var_epi16(x, first, y));
        _mm512_storeu_si512(dst + 64 * c + 32, _mm512_permutex2var_epi16(x, second, y));
      }
    }
  }

  // r[i] holds row i of a 16 x 16 matrix of 32-bit elements; afterwards r[c] holds column c.
  static void transpose16x16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // r[i + k], lane L: column 4L + k of rows i .. i + 3
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; ++k) {
      const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
      const __m512i b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xee);
      const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
      const __m512i d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xee);
      t[k] = _mm512_shuffle_i32x4(a, c, 0x88);
      t[4 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);
      t[8 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
      t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
    for (int c = 0; c < 16; ++c) r[c] = t[c];
  }

  // Rows r .. r + NR through one block together: each K and V pair vector is loaded once for all
  // of them and their dependent chains interleave. The keys past every row's position are
  // skipped; within the rest, a row's masked keys get zero probability, so a row's arithmetic is
  // the same whatever rows share its pass.
  template <int NR>
  void attend_rows(int64_t r, const bf16* const* q, const int64_t* pos, int64_t key, int64_t n) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    int64_t newest = pos[0];
    for (int i = 1; i < NR; ++i) newest = std::max(newest, pos[i]);
    const int64_t seen = std::min<int64_t>(n, newest - key + 1);
    if (seen <= 0) return;
    const int64_t chunks = (seen + kChunk - 1) / kChunk;
    __m512 top[NR];
    for (int i = 0; i < NR; ++i) top[i] = _mm512_set1_ps(neg_inf);
    for (int64_t c = 0; c < chunks; ++c) score_chunk<NR>(q, pos, key + c * kChunk, n - c * kChunk, c, top);
    __m512 correction[NR], row_max[NR];
    for (int i = 0; i < NR; ++i) {
      const float block_max = _mm512_reduce_max_ps(top[i]);
      if (block_max == neg_inf) {  // the row sees none of this block: nothing changes
        correction[i] = _mm512_set1_ps(1.0f);
        row_max[i] = _mm512_setzero_ps();
        continue;
      }
      const float new_max = std::max(m[r + i], block_max);
      correction[i] = exp2_nonpositive(_mm512_set1_ps(m[r + i] - new_max));  // 0 when m was -inf
      row_max[i] = _mm512_set1_ps(new_max);
      m[r + i] = new_max;
    }
    __m512 sum[NR];
    for (int i = 0; i < NR; ++i) sum[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < chunks * kChunk; j += 16) {
      for (int i = 0; i < NR; ++i) {
        const __m512 p = exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(&scores[i][j]), row_max[i]));
        sum[i] = _mm512_add_ps(sum[i], p);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&probs[i][j / 2]), (__m256i)_mm512_cvtneps_pbh(p));
      }
    }
    for (int i = 0; i < NR; ++i)
      l[r + i] = l[r + i] * _mm512_cvtss_f32(correction[i]) + _mm512_reduce_add_ps(sum[i]);
    __m512 out[NR][CH];
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < CH; ++c) out[i][c] = _mm512_mul_ps(_mm512_loadu_ps(&acc[(r + i) * HD + 16 * c]), correction[i]);
    for (int64_t jp = 0; jp < chunks * kChunk / 2; ++jp) {
      __m512bh v[CH];
      for (int c = 0; c < CH; ++c) v[c] = (__m512bh)_mm512_loadu_si512(&vp[jp * HD + 16 * c]);
      for (int i = 0; i < NR; ++i) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(int(probs[i][jp]));
        for (int c = 0; c < CH; ++c) out[i][c] = _mm512_dpbf16_ps(out[i][c], pj, v[c]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(&acc[(r + i) * HD + 16 * c], out[i][c]);
  }

  // The scaled scores of rows' queries for keys key .. key + 31 (chunk c of the block, `left`
  // of its keys packed), -inf where a row may not look, into scores[i]; their maximum into top.
  template <int NR>
  void score_chunk(const bf16* const* q, const int64_t* pos, int64_t key, int64_t left, int64_t c, __m512* top) {
    __m512 s_lo[NR], s_hi[NR], t_lo[NR], t_hi[NR];
    for (int i = 0; i < NR; ++i) s_lo[i] = s_hi[i] = t_lo[i] = t_hi[i] = _mm512_setzero_ps();
    const uint32_t* k = &kp[c * kChunk];
    for (int64_t dp = 0; dp < HD / 2; dp += 2) {
      const __m512bh k0l = (__m512bh)_mm512_loadu_si512(k + dp * kBlock);
      const __m512bh k0h = (__m512bh)_mm512_loadu_si512(k + dp * kBlock + 16);
      const __m512bh k1l = (__m512bh)_mm512_loadu_si512(k + (dp + 1) * kBlock);
      const __m512bh k1h = (__m512bh)_mm512_loadu_si512(k + (dp + 1) * kBlock + 16);
      for (int i = 0; i < NR; ++i) {
        const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q[i]);
        const __m512bh q0 = (__m512bh)_mm512_set1_epi32(int(q32[dp])), q1 = (__m512bh)_mm512_set1_epi32(int(q32[dp + 1]));
        s_lo[i] = _mm512_dpbf16_ps(s_lo[i], q0, k0l);
        s_hi[i] = _mm512_dpbf16_ps(s_hi[i], q0, k0h);
        t_lo[i] = _mm512_dpbf16_ps(t_lo[i], q1, k1l);
        t_hi[i] = _mm512_dpbf16_ps(t_hi[i], q1, k1h);
      }
    }
    const __m512 scale_v = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pos_lo = _mm512_add_epi32(_mm512_set1_epi32(int(key)), iota);
    const __m512i pos_hi = _mm512_add_epi32(pos_lo, _mm512_set1_epi32(16));
    const uint32_t in_block = left >= kChunk ? ~0u : uint32_t((1ull << left) - 1);
    for (int i = 0; i < NR; ++i) {
      const __m512i query = _mm512_set1_epi32(int(pos[i]));
      __mmask16 valid_lo = _mm512_cmple_epi32_mask(pos_lo, query) & __mmask16(in_block);
      __mmask16 valid_hi = _mm512_cmple_epi32_mask(pos_hi, query) & __mmask16(in_block >> 16);
      if (window) {
        const __m512i oldest = _mm512_set1_epi32(int(pos[i] - window));
        valid_lo &= _mm512_cmpgt_epi32_mask(pos_lo, oldest);
        valid_hi &= _mm512_cmpgt_epi32_mask(pos_hi, oldest);
      }
      const __m512 x = _mm512_mask_mul_ps(neg_inf, valid_lo, _mm512_add_ps(s_lo[i], t_lo[i]), scale_v);
      const __m512 y = _mm512_mask_mul_ps(neg_inf, valid_hi, _mm512_add_ps(s_hi[i], t_hi[i]), scale_v);
      _mm512_store_ps(&scores[i][c * kChunk], x);
      _mm512_store_ps(&scores[i][c * kChunk + 16], y);
      top[i] = _mm512_max_ps(top[i], _mm512_max_ps(x, y));
    }
  }
};

}  // namespace pdserve
#endif
