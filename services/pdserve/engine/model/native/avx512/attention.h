// Paged attention over the block-major KV tensor, read in place (no gather), for any mix of
// decode tokens and prefill chunks in one call. A work item is one segment's tile of query
// tokens with all its heads, so each K/V block (every KV head's rows, one contiguous run) is
// read once per tile, converted to float once, and prefetched while the previous one is used:
// a few lines per key worked on, since a block's lines asked for all at once mostly wait (64
// decode tokens over 300 keys, 1 thread: 75 ms prefetched in one burst, 36 spread out).
// (The tensor's layout and a segment's regions: ../paged.h.)
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "../paged.h"
#include "amx_attention.h"
#include "prefill_attention.h"
#include "vec.h"

namespace pdserve {

constexpr int64_t kQueryTile = 16;  // query tokens of one segment per work item
// In bf16, prompt chunks and any chunk of at least kMinPackedTile tokens use the packed path,
// in tiles of up to kPackedTile tokens: each tile packs every K/V chunk it sees once, so longer
// tiles pack less. Its arithmetic differs from the per-row path's (bf16 dot products, bf16
// probabilities), so every token of a prompt goes through it however few are left: a prompt's
// KV and first token then come out bit-identical whole, chunked or behind a cached prefix.
constexpr int64_t kMinPackedTile = 4;
constexpr int64_t kPackedTile = 128;
inline bool tiled(const Segment& s) { return s.prompt || s.q_len >= kMinPackedTile; }
#if defined(__AVX512BF16__)
constexpr bool kHasPackedAttention = true;
#else
constexpr bool kHasPackedAttention = false;
#endif

// Whether bf16 prompt tiles run on AMX tile products from now on: where the kernels were built
// for AMX and the system lends its tiles, unless `wanted` is false (then on AVX512-BF16).
inline bool use_amx_attention(bool wanted) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  amx_attention_wanted() = wanted;
  return wanted && amx_permitted();
#else
  return false;
#endif
}

struct WorkItem {
  int32_t segment, t0, t1;  // query tokens [t0, t1) of the segment
};

// q . k over one head as 16 partial sums: bf16 pairs through AVX512-BF16 dot products where
// the CPU has them (exact products, float sums), else float FMAs.
template <int CH>
inline __m512 dot_lanes(const float* q, const float* k) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(k + 16 * c), acc);
  return acc;
}
template <int CH>
inline __m512 dot_lanes(const bf16* q, const bf16* k) {
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < CH; c += 2)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 16 * c), (__m512bh)_mm512_loadu_si512(k + 16 * c));
#else
  __m512 acc = _mm512_mul_ps(load16(q), load16(k));
  for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(load16(q + 16 * c), load16(k + 16 * c), acc);
#endif
  return acc;
}

// Lane i: the sum of v[i]'s 16 lanes, added pairwise as _mm512_reduce_add_ps adds one vector
// (lane j with j + 8, then + 4, + 2, + 1), so each sum has the same bits as there, for 16
// vectors in 45 instructions where 16 reductions take ~130.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 e[8], f[4], g[2];
  for (int k = 0; k < 8; ++k)  // [v 0-7 | w 0-7] + [v 8-15 | w 8-15]
    e[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)  // 4 sums each of 4 vectors, one per 128-bit lane
    f[k] = _mm512_add_ps(_mm512_shuffle_f32x4(e[2 * k], e[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e[2 * k], e[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k) {  // 2 sums each
    const __m512d x = _mm512_castps_pd(f[2 * k]), y = _mm512_castps_pd(f[2 * k + 1]);
    g[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4 * a + b holds v[a + 4 * b]'s sum
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

// One work item, CH = head_dim / 16 vector chunks per head. Row r of the tile is query token
// t0 + r / num_heads, head r % num_heads; online softmax over the key blocks the tile sees,
// reading K and V where they lie in the cache. The query heads of one KV head go through a
// block together: 16 keys' scores per row summed at once (`sum_lanes16`), each V row converted
// once for the whole group.
template <typename T, int CH>
struct TileAttention {
  static constexpr int64_t HD = CH * 16;
  const AttentionArgs<T>& a;
  // V rows weighed together: their sums and one V row fit in the 32 vector registers
  static constexpr int kRowBlock = CH <= 4 ? 4 : CH <= 8 ? 2 : 1;
  int64_t group, s_stride = 0;
  const char *pf_next = nullptr, *pf_end = nullptr;  // what is left to prefetch of the next block
  std::vector<T> q;
  std::vector<float> acc, m, l, s, correction;  // s: a block's scores, then probabilities, per row of a group

  explicit TileAttention(const AttentionArgs<T>& args) : a(args), group(args.num_heads / args.layout.num_kv_heads) {}

  // `then`: the item this thread runs next, whose first block is prefetched during the last one.
  void run(const WorkItem& item, const WorkItem* then = nullptr) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (tiled(a.segments[item.segment])) return run_packed(item);
    }
#endif
    const Segment seg = a.segments[item.segment];
    const int64_t rows = int64_t(item.t1 - item.t0) * a.num_heads, tpb = a.layout.tokens_per_block;
    load_queries(item, seg, rows);
    const int64_t last = last_key(item), first = first_key(item);
    const int32_t* table = a.tables + item.segment * a.table_width;
    s_stride = tpb + 16;
    s.resize(group * s_stride);
    correction.resize(group);
    for (int64_t b = first / tpb; b <= last / tpb; ++b) {
      pump(pf_end - pf_next);  // what the last block's steps left of its prefetch
      if (b < last / tpb)
        start_prefetch(block_base(table[b + 1]));
      else if (then)
        start_prefetch(block_base(a.tables[then->segment * a.table_width + first_key(*then) / tpb]));
      const int64_t num_keys = std::min(tpb, last + 1 - b * tpb);
      const T* kb = block_base(table[b]);
      for (int64_t t = 0; t < item.t1 - item.t0; ++t)
        for (int64_t g = 0; g < a.layout.num_kv_heads; ++g)
          attend_group(t * a.num_heads + g * group, g, seg.start_pos + item.t0 + t, b * tpb, num_keys, kb);
    }
    store(item, seg, rows);
  }

  int64_t last_key(const WorkItem& item) const { return a.segments[item.segment].start_pos + item.t1 - 1; }
  int64_t first_key(const WorkItem& item) const {
    return a.window ? std::max<int64_t>(0, a.segments[item.segment].start_pos + item.t0 - a.window + 1) : 0;
  }

#if defined(__AVX512BF16__)
  // Tiles of several query tokens in bf16: per KV head, small matrix products on packed K/V
  // (AMX tile products where the CPU has them and the system lends them).
  void run_packed(const WorkItem& item) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_attention_wanted().load(std::memory_order_relaxed) && amx_permitted())
      return run_packed_on<AmxTileAttention<CH>>(item);
#endif
    run_packed_on<Bf16TileAttention<CH>>(item);
  }

  template <typename Tile>
  void run_packed_on(const WorkItem& item) {
    const Segment seg = a.segments[item.segment];
    const KvLayout& L = a.layout;
    const int64_t tokens = item.t1 - item.t0, rows = tokens * group;
    Tile tile(reinterpret_cast<const bf16*>(a.kv) + a.layer * 2 * L.kind_stride(), L.block_stride(),
                               L.num_kv_heads * HD, L.kind_stride(), a.scale, a.window);
    std::vector<const bf16*> q_rows(rows);
    std::vector<int64_t> positions(rows);
    std::vector<float> out(rows * HD);
    const int64_t last = last_key(item), first = first_key(item);
    for (int64_t g = 0; g < L.num_kv_heads; ++g) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = seg.q_start + item.t0 + r / group;
        q_rows[r] = reinterpret_cast<const bf16*>(a.q) + token * a.q_row_stride + (g * group + r % group) * HD;
        positions[r] = seg.start_pos + item.t0 + r / group;
      }
      tile.run(q_rows.data(), positions.data(), rows, a.tables + item.segment * a.table_width, L.tokens_per_block,
               first, last, g, out.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = seg.q_start + item.t0 + r / group;
        T* dst = a.out + token * a.num_heads * HD + (g * group + r % group) * HD;
        for (int c = 0; c < CH; ++c) store16(dst + 16 * c, _mm512_loadu_ps(&out[r * HD + 16 * c]));
      }
    }
  }
#endif

  const T* block_base(int32_t block) const {
    return a.kv + block * a.layout.block_stride() + a.layer * 2 * a.layout.kind_stride();
  }

  // The next block's K and V are prefetched into L2 a few lines per key while this block is
  // worked on (`pump`), the rest at its end.
  void start_prefetch(const T* base) {
    pf_next = reinterpret_cast<const char*>(base);
    pf_end = pf_next + 2 * a.layout.kind_stride() * int64_t(sizeof(T));
  }

  void pump(int64_t bytes) {
    const char* stop = std::min(pf_end, pf_next + bytes);
    for (; pf_next < stop; pf_next += 64) _mm_prefetch(pf_next, _MM_HINT_T1);
  }

  void load_queries(const WorkItem& item, const Segment& seg, int64_t rows) {
    q.resize(rows * HD);
    acc.assign(rows * HD, 0.0f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = seg.q_start + item.t0 + r / a.num_heads, head = r % a.num_heads;
      std::memcpy(&q[r * HD], a.q + token * a.q_row_stride + head * HD, HD * sizeof(T));
    }
  }

  // Rows r0 .. r0 + group (one query token's heads of KV head `g`) over one block's keys.
  void attend_group(int64_t r0, int64_t g, int64_t query_pos, int64_t first_key, int64_t num_keys, const T* kb) {
    const int64_t key_stride = a.layout.num_kv_heads * HD;
    const T* kh = kb + g * HD;
    const T* vh = kh + a.layout.kind_stride();
    // Keys the rows see in the block: [lo, hi).
    const int64_t hi = std::min(num_keys, query_pos - first_key + 1);
    const int64_t lo = a.window ? std::max<int64_t>(0, query_pos - a.window + 1 - first_key) : 0;
    if (hi <= lo) return;
    for (int64_t i = 0; i < group; ++i) {
      float* sr = &s[i * s_stride];
      scores(&q[(r0 + i) * HD], kh, key_stride, lo, hi, sr);
      correction[i] = softmax_block(r0 + i, sr, hi);
    }
    int64_t i = 0;
    for (; i + kRowBlock <= group; i += kRowBlock) weigh_values<kRowBlock>(r0 + i, i, vh, key_stride, lo, hi);
    switch (group - i) {
      case 3: weigh_values<3>(r0 + i, i, vh, key_stride, lo, hi); break;
      case 2: weigh_values<2>(r0 + i, i, vh, key_stride, lo, hi); break;
      case 1: weigh_values<1>(r0 + i, i, vh, key_stride, lo, hi); break;
      default: break;
    }
  }

  // sr[j] = q . k_j * scale for the block's keys j in [lo, hi), -inf below lo.
  void scores(const T* qr, const T* kh, int64_t key_stride, int64_t lo, int64_t hi, float* sr) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < lo; ++j) sr[j] = neg_inf;
    const __m512 scale = _mm512_set1_ps(a.scale);
    __m512 d[16];
    for (int64_t j0 = lo; j0 < hi; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, hi - j0);
      for (int64_t j = 0; j < 16; ++j) d[j] = j < n ? dot_lanes<CH>(qr, kh + (j0 + j) * key_stride) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(sr + j0, (__mmask16)((1u << n) - 1), _mm512_mul_ps(sum_lanes16(d), scale));
    }
  }

  // Row r's online softmax over scores sr[0, hi) (-inf where unseen): sr becomes the
  // probabilities; returns the factor the row's earlier sums are scaled by.
  float softmax_block(int64_t r, float* sr, int64_t hi) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    __m512 maxes = _mm512_set1_ps(neg_inf);
    for (int64_t j = 0; j < hi; j += 16) {
      const __mmask16 lanes = (__mmask16)((1u << std::min<int64_t>(16, hi - j)) - 1);
      maxes = _mm512_max_ps(maxes, _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), lanes, &sr[j]));
    }
    const float block_max = _mm512_reduce_max_ps(maxes);
    const float new_max = std::max(m[r], block_max);
    const float scale_old = m[r] == neg_inf ? 0.0f : std::exp(m[r] - new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < hi; j += 16) {
      const __mmask16 lanes = (__mmask16)((1u << std::min<int64_t>(16, hi - j)) - 1);
      __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), lanes, &sr[j]);
      __m512 p = exp16(_mm512_sub_ps(x, _mm512_set1_ps(new_max)));
      sum = _mm512_add_ps(sum, p);
      _mm512_mask_storeu_ps(&sr[j], lanes, p);
    }
    l[r] = l[r] * scale_old + _mm512_reduce_add_ps(sum);
    m[r] = new_max;
    return scale_old;
  }

  // acc rows r .. r + NR += their probabilities (s rows i ..) times V rows [lo, hi), each V row
  // loaded and widened once for all NR rows.
  static constexpr int PF = CH;  // lines pumped per V row: a block's K and V over its V rows
  template <int NR>
  void weigh_values(int64_t r, int64_t i, const T* vh, int64_t key_stride, int64_t lo, int64_t hi) {
    __m512 o[NR][CH];
    for (int n = 0; n < NR; ++n)
      for (int c = 0; c < CH; ++c)
        o[n][c] = _mm512_mul_ps(_mm512_loadu_ps(&acc[(r + n) * HD + c * 16]), _mm512_set1_ps(correction[i + n]));
    for (int64_t j = lo; j < hi; ++j) {
      __m512 v[CH];
      for (int c = 0; c < CH; ++c) v[c] = load16(vh + j * key_stride + c * 16);
      pump(PF * 64);
      for (int n = 0; n < NR; ++n) {
        const __m512 p = _mm512_set1_ps(s[(i + n) * s_stride + j]);
        for (int c = 0; c < CH; ++c) o[n][c] = _mm512_fmadd_ps(p, v[c], o[n][c]);
      }
    }
    for (int n = 0; n < NR; ++n)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(&acc[(r + n) * HD + c * 16], o[n][c]);
  }

  void store(const WorkItem& item, const Segment& seg, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = seg.q_start + item.t0 + r / a.num_heads, head = r % a.num_heads;
      T* dst = a.out + token * a.num_heads * HD + head * HD;
      const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
      for (int c = 0; c < CH; ++c) store16(dst + c * 16, _mm512_mul_ps(_mm512_loadu_ps(&acc[r * HD + c * 16]), inv));
    }
  }
};

template <typename T, int CH>
void run_items(const AttentionArgs<T>& a, const std::vector<WorkItem>& items) {
  std::atomic<int64_t> next{0};
  const int64_t num_items = int64_t(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    TileAttention<T, CH> tile(a);
    for (int64_t i = next++; i < num_items;) {
      const int64_t then = next++;
      tile.run(items[i], then < num_items ? &items[then] : nullptr);
      i = then;
    }
  });
}

// The segments `ids` (all when empty); head_dim a multiple of 32 up to 256 (the caller checks).
template <typename T>
void paged_attention(const AttentionArgs<T>& a, const std::vector<int32_t>& ids = {}) {
  std::vector<WorkItem> items;
  auto add = [&](int32_t s) {
    const int32_t len = a.segments[s].q_len;
    const bool packed = kHasPackedAttention && std::is_same_v<T, bf16> && tiled(a.segments[s]);
    const int32_t tile = int32_t(packed ? kPackedTile : kQueryTile);
    for (int32_t t0 = 0; t0 < len; t0 += tile) items.push_back({s, t0, std::min<int32_t>(len, t0 + tile)});
  };
  if (ids.empty())
    for (int32_t s = 0; s < a.num_segments; ++s) add(s);
  for (int32_t s : ids) add(s);
  // Later tiles of a long chunk see more keys: hand the costliest out first.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& x, const WorkItem& y) {
    return a.segments[x.segment].start_pos + x.t1 > a.segments[y.segment].start_pos + y.t1;
  });
  switch (a.layout.head_dim / 16) {
    case 2: return run_items<T, 2>(a, items);
    case 4: return run_items<T, 4>(a, items);
    case 6: return run_items<T, 6>(a, items);
    case 8: return run_items<T, 8>(a, items);
    case 10: return run_items<T, 10>(a, items);
    case 12: return run_items<T, 12>(a, items);
    case 14: return run_items<T, 14>(a, items);
    default: return run_items<T, 16>(a, items);
  }
}

}  // namespace pdserve
