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
#include <limits>
#include <vector>

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

struct WorkItem {
  int32_t segment, t0, t1;  // query tokens [t0, t1) of the segment
};

// One work item, CH = head_dim / 16 vector chunks per head. Row r of the tile is query token
// t0 + r / num_heads, head r % num_heads; online softmax over the key blocks the tile sees.
template <typename T, int CH>
struct TileAttention {
  static constexpr int64_t HD = CH * 16;
  const AttentionArgs<T>& a;
  int64_t group;
  std::vector<float> q, acc, m, l, k, v, s;

  explicit TileAttention(const AttentionArgs<T>& args) : a(args), group(args.num_heads / args.layout.num_kv_heads) {}

  void run(const WorkItem& item) {
    const Segment seg = a.segments[item.segment];
    const int64_t rows = int64_t(item.t1 - item.t0) * a.num_heads, tpb = a.layout.tokens_per_block;
    load_queries(item, seg, rows);
    const int64_t last = seg.start_pos + item.t1 - 1;  // the last key any row sees
    const int64_t first = a.window ? std::max<int64_t>(0, seg.start_pos + item.t0 - a.window + 1) : 0;
    const int32_t* table = a.tables + item.segment * a.table_width;
    for (int64_t b = first / tpb; b <= last / tpb; ++b) {
      const int64_t num_keys = std::min(tpb, last + 1 - b * tpb);
      load_block(table[b], num_keys, b < last / tpb ? block_base(table[b + 1]) : nullptr);
      for (int64_t r = 0; r < rows; ++r)
        attend_block(r, seg.start_pos + item.t0 + r / a.num_heads, b * tpb, num_keys);
    }
    store(item, seg, rows);
  }

  const T* block_base(int32_t block) const {
    return a.kv + block * a.layout.block_stride() + a.layer * 2 * a.layout.kind_stride();
  }

  void load_queries(const WorkItem& item, const Segment& seg, int64_t rows) {
    q.resize(rows * HD);
    acc.assign(rows * HD, 0.0f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = seg.q_start + item.t0 + r / a.num_heads, head = r % a.num_heads;
      const T* src = a.q + token * a.q_row_stride + head * HD;
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(&q[r * HD + c * 16], _mm512_mul_ps(load16(src + c * 16), scale));
    }
  }

  // K and V of every KV head for the block's first num_keys tokens, as float (tpb, kvh, hd),
  // prefetching the next block's line for each line read (`next` may be null).
  void load_block(int32_t block, int64_t num_keys, const T* next) {
    const int64_t n = num_keys * a.layout.num_kv_heads * HD, kind = a.layout.kind_stride();
    constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
    const T* base = block_base(block);
    k.resize(kind);
    v.resize(kind);
    s.resize(a.layout.tokens_per_block + 16);
    float* kf = k.data();
    float* vf = v.data();
    for (int64_t i = 0; i < n; i += 16) {
      if (next && i % kLine == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + kind + i), _MM_HINT_T0);
      }
      _mm512_storeu_ps(kf + i, load16(base + i));
      _mm512_storeu_ps(vf + i, load16(base + kind + i));
    }
  }

  void attend_block(int64_t r, int64_t query_pos, int64_t first_key, int64_t num_keys) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t kv_head = (r % a.num_heads) / group, key_stride = a.layout.num_kv_heads * HD;
    const float* qr = &q[r * HD];
    const float* kh = &k[kv_head * HD];
    // Keys this row sees in the block: [lo, hi).
    const int64_t hi = std::min(num_keys, query_pos - first_key + 1);
    const int64_t lo = a.window ? std::max<int64_t>(0, query_pos - a.window + 1 - first_key) : 0;
    if (hi <= lo) return;
    __m512 qv[CH];
    for (int c = 0; c < CH; ++c) qv[c] = _mm512_loadu_ps(qr + c * 16);
    float block_max = neg_inf;
    for (int64_t j = 0; j < lo; ++j) s[j] = neg_inf;
    for (int64_t j = lo; j < hi; ++j) {
      const float* kj = kh + j * key_stride;
      __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
      for (int c = 1; c < CH; ++c) dot = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + c * 16), dot);
      s[j] = _mm512_reduce_add_ps(dot);
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
    const float* vh = &v[kv_head * HD];
    __m512 o[CH];
    for (int c = 0; c < CH; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(out + c * 16), _mm512_set1_ps(correction));
    for (int64_t j = lo; j < hi; ++j) {
      const __m512 p = _mm512_set1_ps(s[j]);
      for (int c = 0; c < CH; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vh + j * key_stride + c * 16), o[c]);
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
    for (int32_t t0 = 0; t0 < a.segments[s].q_len; t0 += kQueryTile)
      items.push_back({s, t0, std::min<int32_t>(a.segments[s].q_len, t0 + kQueryTile)});
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
