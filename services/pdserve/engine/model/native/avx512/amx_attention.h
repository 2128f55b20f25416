// Attention for tiles of many query tokens in bf16 on AMX tiles (CPUs with amx_bf16): the K and
// V blocks packed as for Bf16TileAttention (bf16 pairs by dimension and by key are exactly the
// layout of a tile product's second operand), the same softmax per 128-key block in powers of
// two, but both products as 16 x 16 tile products over 16 query rows at a time: QK^T takes hd/32
// per 16 keys, P.V one per 32 keys and 16 dimensions, where the AVX512-BF16 kernel spends a
// dot-product instruction per pair of dimensions and per row. A row's arithmetic depends only on
// its own query and the keys it sees (a tile product's rows are independent), and blocks start
// at multiples of 128 positions, so a prompt's rows come out the same bits whole, chunked or
// behind a cached prefix.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "prefill_attention.h"

namespace pdserve {

// Linux lends a process AMX's tile state when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA, 0x1023 and 18); oneDNN asks before its own AMX kernels, attention asks here once.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Cleared to keep bf16 prompt tiles on the AVX512-BF16 kernel (its tests on AMX CPUs).
inline std::atomic<bool>& amx_attention_wanted() {
  static std::atomic<bool> wanted{true};
  return wanted;
}

// GCC's tile intrinsics name their tiles by literal tokens: these take the number as a value
// (a constant wherever they are called, so each switch folds to its one instruction).
#define PDSERVE_TILE_CASES(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
inline void tile_load(int t, const void* base, int64_t stride) {
#define PDSERVE_LOAD(n) \
  case n: _tile_loadd(n, base, stride); break;
  switch (t) { PDSERVE_TILE_CASES(PDSERVE_LOAD) }
#undef PDSERVE_LOAD
}
inline void tile_store(int t, void* base, int64_t stride) {
#define PDSERVE_STORE(n) \
  case n: _tile_stored(n, base, stride); break;
  switch (t) { PDSERVE_TILE_CASES(PDSERVE_STORE) }
#undef PDSERVE_STORE
}
// Sums 0 and 1 += queries in tile 4 + t times keys in tiles 2 and 3.
inline void score_products(int t) {
  switch (t) {
    case 0: _tile_dpbf16ps(0, 4, 2); _tile_dpbf16ps(1, 4, 3); break;
    case 1: _tile_dpbf16ps(0, 5, 2); _tile_dpbf16ps(1, 5, 3); break;
    case 2: _tile_dpbf16ps(0, 6, 2); _tile_dpbf16ps(1, 6, 3); break;
    case 3: _tile_dpbf16ps(0, 7, 2); _tile_dpbf16ps(1, 7, 3); break;
  }
}
// Sum 4 + q += probabilities in tile 2 times values in tile q % 2.
inline void value_product(int q) {
  switch (q) {
    case 0: _tile_dpbf16ps(4, 2, 0); break;
    case 1: _tile_dpbf16ps(5, 2, 1); break;
    case 2: _tile_dpbf16ps(6, 2, 0); break;
    case 3: _tile_dpbf16ps(7, 2, 1); break;
  }
}
#undef PDSERVE_TILE_CASES

// 2^x for finite x, 2^f by a degree-5 polynomial fitted for relative error (2.4e-7 evaluated in
// float): nine instructions, without exp2_nonpositive's clamp, as no -inf reaches it here
// (masked lanes are zeroed after).
inline __m512 exp2_finite(__m512 x) {
  static constexpr float fit5[] = {1.32764717371434e-3f, 9.675541540087755e-3f, 5.550713276094129e-2f,
                                   2.4022119720074547e-1f, 6.931469670620418e-1f, 1.000000071655432f};
  return exp2_by(x, fit5);
}

struct alignas(64) TileConfig {  // palette 1, the first eight tiles 16 rows of 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

template <int CH>
struct AmxTileAttention : Bf16TileAttention<CH> {
  using Base = Bf16TileAttention<CH>;
  using Base::HD, Base::kBlock, Base::kChunk, Base::kp, Base::vp, Base::acc, Base::m, Base::l, Base::scale,
      Base::window, Base::pack;
  static constexpr int64_t kRows = 16;  // query rows per tile product
  std::vector<bf16> q;                  // (rows padded to 16, HD): the tile's queries, padding rows zero
  std::vector<int64_t> pos;             // their positions, -1 for padding (it sees no key)
  alignas(64) float s[kRows][kBlock];   // raw q.k (the exponent's FMA scales them)
  alignas(64) uint16_t p[kRows][kBlock];  // bf16 probabilities

  using Base::Base;

  // As Bf16TileAttention::run.
  void run(const bf16* const* q_rows, const int64_t* positions, int64_t rows, const int32_t* table, int64_t tpb,
           int64_t first_key, int64_t last_key, int64_t kv_head, float* out_rows) {
    const int64_t padded = (rows + kRows - 1) / kRows * kRows;
    q.assign(padded * HD, bf16{0});
    pos.assign(padded, -1);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(q_rows[r], q_rows[r] + HD, &q[r * HD]);
      pos[r] = positions[r];
    }
    acc.assign(padded * HD, 0.0f);
    m.assign(padded, -std::numeric_limits<float>::infinity());
    l.assign(padded, 0.0f);
    kp.resize(HD / 2 * kBlock);
    vp.resize(kBlock / 2 * HD);
    TileConfig config;
    _tile_loadconfig(&config);
    for (int64_t key = first_key - first_key % kBlock; key <= last_key; key += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, last_key + 1 - key);
      pack(table, tpb, key, n, kv_head);
      for (int64_t r = 0; r < padded; r += kRows) attend16(r, key, n);
    }
    _tile_release();
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t d = 0; d < HD; ++d) out_rows[r * HD + d] = acc[r * HD + d] * inv;
    }
  }

  // Rows r .. r + 15 through keys key .. key + n - 1.
  void attend16(int64_t r, int64_t key, int64_t n) {
    const int64_t newest = *std::max_element(&pos[r], &pos[r] + kRows);
    const int64_t seen = std::min<int64_t>(n, newest - key + 1);
    if (seen <= 0) return;
    const int64_t chunks = (seen + kChunk - 1) / kChunk;
    if constexpr (HD <= 128)
      score(r, chunks, std::make_integer_sequence<int, int(HD / 32)>{});
    else
      score_wide(r, chunks);
    const int64_t oldest = *std::min_element(&pos[r], &pos[r] + kRows);
    const bool whole = n % kChunk == 0 && key + n - 1 <= oldest && (!window || key > newest - window);
    if (whole && chunks == kBlock / kChunk)
      for (int64_t i = 0; i < kRows; i += 2) softmax_pair(r + i, i);
    else
      for (int64_t i = 0; i < kRows; ++i) softmax_row(r + i, i, key, n, chunks, whole);
    int64_t c = 0;
    for (; c + 4 <= CH; c += 4) weigh_values(r, c, chunks, std::make_integer_sequence<int, 4>{});
    if (c < CH) weigh_values(r, c, chunks, std::make_integer_sequence<int, 2>{});  // CH is even
  }

  // s = q.k for the rows' 32-key chunks: the queries' hd/32 tiles stay in tiles 4.. for the
  // whole block; keys through tiles 2 and 3, sums in 0 and 1.
  template <int... T>
  void score(int64_t r, int64_t chunks, std::integer_sequence<int, T...>) {
    (tile_load(4 + T, &q[r * HD + 32 * T], HD * sizeof(bf16)), ...);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_zero(0);
      _tile_zero(1);
      ((tile_load(2, &kp[16 * T * kBlock + c * kChunk], kBlock * sizeof(uint32_t)),
        tile_load(3, &kp[16 * T * kBlock + c * kChunk + 16], kBlock * sizeof(uint32_t)), score_products(T)),
       ...);
      _tile_stored(0, &s[0][c * kChunk], kBlock * sizeof(float));
      _tile_stored(1, &s[0][c * kChunk + 16], kBlock * sizeof(float));
    }
  }

  // The same for heads wider than 128, the queries loaded again per chunk.
  void score_wide(int64_t r, int64_t chunks) {
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t t = 0; t < HD / 32; ++t) {
        _tile_loadd(2, &q[r * HD + 32 * t], HD * sizeof(bf16));
        _tile_loadd(3, &kp[16 * t * kBlock + c * kChunk], kBlock * sizeof(uint32_t));
        _tile_loadd(4, &kp[16 * t * kBlock + c * kChunk + 16], kBlock * sizeof(uint32_t));
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, &s[0][c * kChunk], kBlock * sizeof(float));
      _tile_stored(1, &s[0][c * kChunk + 16], kBlock * sizeof(float));
    }
  }

  // acc columns 16c .. 16(c + |Q|) += P.V: the sums in tiles 4.., each chunk's probabilities
  // loaded once into tile 2, values through tiles 0 and 1.
  template <int... Q>
  void weigh_values(int64_t r, int64_t c, int64_t chunks, std::integer_sequence<int, Q...>) {
    (tile_load(4 + Q, &acc[r * HD + 16 * (c + Q)], HD * sizeof(float)), ...);
    for (int64_t k = 0; k < chunks; ++k) {
      tile_load(2, &p[0][k * kChunk], kBlock * sizeof(uint16_t));
      ((tile_load(Q % 2, &vp[k * kChunk / 2 * HD + 16 * (c + Q)], HD * sizeof(uint32_t)), value_product(Q)), ...);
    }
    (tile_store(4 + Q, &acc[r * HD + 16 * (c + Q)], HD * sizeof(float)), ...);
  }

  // softmax_row of two rows that see the whole block, interleaved (the same bits).
  void softmax_pair(int64_t r, int64_t i) {
    constexpr int V = kBlock / 16;
    __m512 top[2];
    for (int k = 0; k < 2; ++k) {
      __m512 a = _mm512_load_ps(&s[i + k][0]), b = _mm512_load_ps(&s[i + k][16]);
      for (int v = 2; v < V; v += 2) {
        a = _mm512_max_ps(a, _mm512_load_ps(&s[i + k][16 * v]));
        b = _mm512_max_ps(b, _mm512_load_ps(&s[i + k][16 * v + 16]));
      }
      top[k] = _mm512_max_ps(a, b);
    }
    __m512 scale_v = _mm512_set1_ps(scale), minus_max[2];
    for (int k = 0; k < 2; ++k) {
      const float new_max = std::max(m[r + k], _mm512_reduce_max_ps(top[k]) * scale);
      if (new_max != m[r + k]) {
        const __m512 correction = exp2_nonpositive(_mm512_set1_ps(m[r + k] - new_max));
        l[r + k] *= _mm512_cvtss_f32(correction);
        for (int64_t c = 0; c < CH; ++c)
          _mm512_storeu_ps(&acc[(r + k) * HD + 16 * c],
                           _mm512_mul_ps(_mm512_loadu_ps(&acc[(r + k) * HD + 16 * c]), correction));
        m[r + k] = new_max;
      }
      minus_max[k] = _mm512_set1_ps(-new_max);
    }
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int v = 0; v < V; ++v) {
      for (int k = 0; k < 2; ++k) {
        const __m512 e = exp2_finite(_mm512_fmadd_ps(_mm512_load_ps(&s[i + k][16 * v]), scale_v, minus_max[k]));
        sum[k] = _mm512_add_ps(sum[k], e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&p[i + k][16 * v]), (__m256i)_mm512_cvtneps_pbh(e));
      }
    }
    for (int k = 0; k < 2; ++k) l[r + k] += _mm512_reduce_add_ps(sum[k]);
  }

  // Row r (i of the tile): its probabilities in bf16 for keys up to chunks * 32, its sum and
  // outputs rescaled to the new maximum. Scores stay raw until the exponent's FMA scales them
  // (scale > 0, so the largest raw score gives the largest scaled one, to the bit); `whole`:
  // every row of the tile sees all chunks * 32 keys, so no mask is built, with the same bits.
  void softmax_row(int64_t r, int64_t i, int64_t key, int64_t n, int64_t chunks, bool whole) {
    const float neg_inf_f = -std::numeric_limits<float>::infinity();
    const int64_t vectors = chunks * kChunk / 16;
    __mmask16 valid[kBlock / 16];
    __m512 top = _mm512_set1_ps(neg_inf_f);
    if (whole) {
      for (int64_t v = 0; v < vectors; ++v) top = _mm512_max_ps(top, _mm512_load_ps(&s[i][16 * v]));
    } else {
      const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i query = _mm512_set1_epi32(int(pos[r])), oldest = _mm512_set1_epi32(int(pos[r] - window));
      for (int64_t v = 0; v < vectors; ++v) {
        const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(int(key + 16 * v)), iota);
        const int64_t left = n - 16 * v;
        valid[v] = _mm512_cmple_epi32_mask(keys, query) &
                   __mmask16(left >= 16 ? 0xffffu : left <= 0 ? 0u : (1u << left) - 1);
        if (window) valid[v] &= _mm512_cmpgt_epi32_mask(keys, oldest);
        top = _mm512_mask_max_ps(top, valid[v], top, _mm512_load_ps(&s[i][16 * v]));
      }
    }
    const float block_max = _mm512_reduce_max_ps(top);
    if (block_max == neg_inf_f) {  // the row sees none of the block: nothing changes
      std::memset(&p[i][0], 0, vectors * 16 * sizeof(uint16_t));
      return;
    }
    const float new_max = std::max(m[r], block_max * scale);
    if (new_max != m[r]) {
      const __m512 correction = exp2_nonpositive(_mm512_set1_ps(m[r] - new_max));  // 0 when m was -inf
      l[r] *= _mm512_cvtss_f32(correction);
      for (int64_t c = 0; c < CH; ++c)
        _mm512_storeu_ps(&acc[r * HD + 16 * c], _mm512_mul_ps(_mm512_loadu_ps(&acc[r * HD + 16 * c]), correction));
      m[r] = new_max;
    }
    const __m512 scale_v = _mm512_set1_ps(scale), minus_max = _mm512_set1_ps(-new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      __m512 e = exp2_finite(_mm512_fmadd_ps(_mm512_load_ps(&s[i][16 * v]), scale_v, minus_max));
      if (!whole) e = _mm512_maskz_mov_ps(valid[v], e);
      sum = _mm512_add_ps(sum, e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(&p[i][16 * v]), (__m256i)_mm512_cvtneps_pbh(e));
    }
    l[r] += _mm512_reduce_add_ps(sum);
  }
};

}  // namespace pdserve
#endif
