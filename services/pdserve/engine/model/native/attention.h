// Paged attention over the block-major KV tensor, read in place (no gather), for any mix of
// decode tokens and prefill chunks in one call. A work item is one segment's tile of query
// tokens with all its heads, so each K/V block (every KV head's rows, one contiguous run) is
// read once per tile, converted to float once, and prefetched while the previous one is used.
//
//   kv tensor (num_blocks, L, 2, tpb, kvh, hd); a segment is one sequence's chunk:
//   | start_pos tokens already in KV | q_len new tokens (their K/V already written) |
//   query token i sits at position start_pos + i and sees keys 0 .. start_pos + i
//   (and only the last `window` of them when a sliding window is set).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "prefill_attention.h"
#include "vec.h"

namespace pdserve {

struct KvLayout {
  int64_t num_layers, tokens_per_block, num_kv_heads, head_dim;
  int64_t kind_stride() const { return tokens_per_block * num_kv_heads * head_dim; }
  int64_t block_stride() const { return num_layers * 2 * kind_stride(); }
};

struct Segment {
  int32_t q_start, q_len, start_pos;
};

template <typename T>
struct AttentionArgs {
  const T* q;  // head h of token t at q + t * q_row_stride + h * hd
  int64_t q_row_stride, num_heads;
  const T* kv;
  KvLayout layout;
  int64_t layer;
  const Segment* segments;
  int64_t num_segments;
  const int32_t* tables;  // (num_segments, table_width) physical block ids
  int64_t table_width;
  float scale;
  int64_t window;  // 0: none
  T* out;          // (T, num_heads * hd)
};

constexpr int64_t kQueryTile = 16;  // query tokens of one segment per work item
// bf16 chunks of at least kMinPackedTile tokens use the packed path, in tiles of up to
// kPackedTile tokens: each tile packs every K/V chunk it sees once, so longer tiles pack less.
constexpr int64_t kMinPackedTile = 4;
constexpr int64_t kPackedTile = 128;
#if defined(__AVX512BF16__)
constexpr bool kHasPackedAttention = true;
#else
constexpr bool kHasPackedAttention = false;
#endif

struct WorkItem {
  int32_t segment, t0, t1;  // query tokens [t0, t1) of the segment
};

// q . k over one head: bf16 pairs through AVX512-BF16 dot products where the CPU has them
// (exact products, float sums), else float FMAs.
template <int CH>
inline float dot_head(const float* q, const float* k) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(k + 16 * c), acc);
  return _mm512_reduce_add_ps(acc);
}
template <int CH>
inline float dot_head(const bf16* q, const bf16* k) {
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < CH; c += 2)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 16 * c), (__m512bh)_mm512_loadu_si512(k + 16 * c));
#else
  __m512 acc = _mm512_mul_ps(load16(q), load16(k));
  for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(load16(q + 16 * c), load16(k + 16 * c), acc);
#endif
  return _mm512_reduce_add_ps(acc);
}

// One work item, CH = head_dim / 16 vector chunks per head. Row r of the tile is query token
// t0 + r / num_heads, head r % num_heads; online softmax over the key blocks the tile sees,
// reading K and V where they lie in the cache.
template <typename T, int CH>
struct TileAttention {
  static constexpr int64_t HD = CH * 16;
  const AttentionArgs<T>& a;
  int64_t group;
  std::vector<T> q;
  std::vector<float> acc, m, l, s;

  explicit TileAttention(const AttentionArgs<T>& args) : a(args), group(args.num_heads / args.layout.num_kv_heads) {}

  void run(const WorkItem& item) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (item.t1 - item.t0 >= kMinPackedTile) return run_packed(item);
    }
#endif
    const Segment seg = a.segments[item.segment];
    const int64_t rows = int64_t(item.t1 - item.t0) * a.num_heads, tpb = a.layout.tokens_per_block;
    load_queries(item, seg, rows);
    const int64_t last = seg.start_pos + item.t1 - 1;  // the last key any row sees
    const int64_t first = a.window ? std::max<int64_t>(0, seg.start_pos + item.t0 - a.window + 1) : 0;
    const int32_t* table = a.tables + item.segment * a.table_width;
    s.resize(tpb + 16);
    for (int64_t b = first / tpb; b <= last / tpb; ++b) {
      if (b < last / tpb) prefetch(block_base(table[b + 1]));
      const int64_t num_keys = std::min(tpb, last + 1 - b * tpb);
      const T* kb = block_base(table[b]);
      for (int64_t r = 0; r < rows; ++r)
        attend_block(r, seg.start_pos + item.t0 + r / a.num_heads, b * tpb, num_keys, kb);
    }
    store(item, seg, rows);
  }

#if defined(__AVX512BF16__)
  // Tiles of several query tokens in bf16: per KV head, small matrix products on packed K/V.
  void run_packed(const WorkItem& item) {
    const Segment seg = a.segments[item.segment];
    const KvLayout& L = a.layout;
    const int64_t tokens = item.t1 - item.t0, rows = tokens * group;
    Bf16TileAttention<CH> tile(reinterpret_cast<const bf16*>(a.kv) + a.layer * 2 * L.kind_stride(), L.block_stride(),
                               L.num_kv_heads * HD, L.kind_stride(), a.scale, a.window);
    std::vector<const bf16*> q_rows(rows);
    std::vector<int64_t> positions(rows);
    std::vector<float> out(rows * HD);
    const int64_t last = seg.start_pos + item.t1 - 1;
    const int64_t first = a.window ? std::max<int64_t>(0, seg.start_pos + item.t0 - a.window + 1) : 0;
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

  void prefetch(const T* base) const {
    const char* bytes = reinterpret_cast<const char*>(base);
    const int64_t size = 2 * a.layout.kind_stride() * int64_t(sizeof(T));
    for (int64_t off = 0; off < size; off += 64) _mm_prefetch(bytes + off, _MM_HINT_T0);
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

  void attend_block(int64_t r, int64_t query_pos, int64_t first_key, int64_t num_keys, const T* kb) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t key_stride = a.layout.num_kv_heads * HD;
    const T* kh = kb + ((r % a.num_heads) / group) * HD;
    const T* vh = kh + a.layout.kind_stride();
    // Keys this row sees in the block: [lo, hi).
    const int64_t hi = std::min(num_keys, query_pos - first_key + 1);
    const int64_t lo = a.window ? std::max<int64_t>(0, query_pos - a.window + 1 - first_key) : 0;
    if (hi <= lo) return;
    const T* qr = &q[r * HD];
    float block_max = neg_inf;
    for (int64_t j = 0; j < lo; ++j) s[j] = neg_inf;
    for (int64_t j = lo; j < hi; ++j) {
      s[j] = dot_head<CH>(qr, kh + j * key_stride) * a.scale;
      block_max = std::max(block_max, s[j]);
    }
    const float new_max = std::max(m[r], block_max);
    const float correction = m[r] == neg_inf ? 0.0f : std::exp(m[r] - new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < hi; j += 16) {
      const __mmask16 lanes = (__mmask16)((1u << std::min<int64_t>(16, hi - j)) - 1);
      __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), lanes, &s[j]);
      __m512 p = exp16(_mm512_sub_ps(x, _mm512_set1_ps(new_max)));
      sum = _mm512_add_ps(sum, p);
      _mm512_mask_storeu_ps(&s[j], lanes, p);
    }
    l[r] = l[r] * correction + _mm512_reduce_add_ps(sum);
    m[r] = new_max;
    float* out = &acc[r * HD];
    __m512 o[CH];
    for (int c = 0; c < CH; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(out + c * 16), _mm512_set1_ps(correction));
    for (int64_t j = lo; j < hi; ++j) {
      const __m512 p = _mm512_set1_ps(s[j]);
      for (int c = 0; c < CH; ++c) o[c] = _mm512_fmadd_ps(p, load16(vh + j * key_stride + c * 16), o[c]);
    }
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + c * 16, o[c]);
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
    for (int64_t i = next++; i < num_items; i = next++) tile.run(items[i]);
  });
}

// The segments `ids` (all when empty); head_dim a multiple of 32 up to 256 (the caller checks).
template <typename T>
void paged_attention(const AttentionArgs<T>& a, const std::vector<int32_t>& ids = {}) {
  std::vector<WorkItem> items;
  auto add = [&](int32_t s) {
    const int32_t len = a.segments[s].q_len;
    const bool packed = kHasPackedAttention && std::is_same_v<T, bf16> && len >= kMinPackedTile;
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
