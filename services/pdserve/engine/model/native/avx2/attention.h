// Paged attention on AVX2 + FMA over the block-major KV tensor (../paged.h), read in place, for
// any mix of decode tokens and prompt chunks in one call, in float32 or bf16 (widened to float).
//
// A work item is one KV head of one segment's tile of query tokens: its rows are those tokens'
// query heads of that KV head. Keys go by in chunks that start at multiples of 32 positions and
// at block starts; each chunk's K and V rows are widened into float buffers once for all the
// item's rows. Decode tokens (tiles of up to 16), per row: 8 keys' scores at a time (a dot
// product per key in 8 lanes, the 8 summed together by `sum_lanes8`), one online-softmax step
// (maximum, rescale), and the probabilities times V. Prompt tokens, and chunks of at least 4
// tokens (tiles of up to 32): small matrix products over the tile's rows (prompt_attention.h).
// Either way a row's arithmetic depends only on its query, its position and the keys it sees,
// never on the other rows of its item, and every prompt row takes the second path however few a
// chunk holds, so a prompt comes out the same bits whole, chunked or behind a cached prefix.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "../paged.h"
#include "prompt_attention.h"
#include "vec.h"

namespace pdserve {

constexpr int64_t kQueryTile = 16;  // decode tokens of one segment per work item
constexpr int64_t kPromptTile = 32;  // prompt tokens of one segment per work item
constexpr int64_t kMinPromptTile = 4;
constexpr int64_t kKeyChunk = 32;   // keys per softmax step (fewer where a KV block holds fewer)
constexpr int kValueRows = 4;       // rows weighing V together: 4 x 16 dimensions in 8 accumulators

// Whether a segment's rows take the matrix-product path (prompt rows, however few).
inline bool tiled(const Segment& s) { return s.prompt || s.q_len >= kMinPromptTile; }

struct WorkItem {
  int32_t segment, t0, t1, kv_head;  // query tokens [t0, t1) of the segment, one KV head
};

template <typename T>
struct Avx2Attention {
  const AttentionArgs<T>& a;
  const int64_t hd, group;
  // q, o: (rows, hd) queries and output sums; k, v: (kKeyChunk, hd) a chunk widened; s: (rows,
  // kKeyChunk) scores, then probabilities; m, l: running maximum and sum; corr: a chunk's rescale
  std::vector<float> q, o, k, v, s, m, l, corr;
  std::vector<int64_t> pos;  // per row
  PromptTile prompt;

  explicit Avx2Attention(const AttentionArgs<T>& args)
      : a(args), hd(args.layout.head_dim), group(args.num_heads / args.layout.num_kv_heads),
        k(kKeyChunk * args.layout.head_dim), v(kKeyChunk * args.layout.head_dim) {}

  void run(const WorkItem& item) {
    const Segment seg = a.segments[item.segment];
    const int64_t rows = int64_t(item.t1 - item.t0) * group, tpb = a.layout.tokens_per_block;
    load_queries(item, seg, rows);
    const int64_t last = seg.start_pos + item.t1 - 1;
    const int64_t first = a.window ? std::max<int64_t>(0, seg.start_pos + item.t0 - a.window + 1) : 0;
    const int32_t* table = a.tables + item.segment * a.table_width;
    const bool is_tiled = tiled(seg);
    if (is_tiled) prompt.start(q.data(), pos.data(), rows, hd, a.scale, a.window, kKeyChunk);
    int64_t key = std::max(first - first % kKeyChunk, first - first % tpb);
    while (key <= last) {
      const int64_t n = std::min({kKeyChunk - key % kKeyChunk, tpb - key % tpb, last + 1 - key});
      stage(table[key / tpb], key % tpb, n, item.kv_head);
      if (is_tiled) {
        prompt.attend(k.data(), v.data(), key, n);
      } else {
        for (int64_t r = 0; r < rows; ++r) attend_scores(r, key, n);
        weigh_values(rows, n);
      }
      key += n;
    }
    if (is_tiled) return store(item, seg, rows, prompt.o.data(), prompt.l.data());
    store(item, seg, rows, o.data(), l.data());
  }

  void load_queries(const WorkItem& item, const Segment& seg, int64_t rows) {
    q.resize(rows * hd);
    o.assign(rows * hd, 0.0f);
    s.resize(rows * kKeyChunk);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    corr.resize(rows);
    pos.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = seg.q_start + item.t0 + r / group, head = item.kv_head * group + r % group;
      const T* src = a.q + token * a.q_row_stride + head * hd;
      for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(&q[r * hd + d], load8(src + d));
      pos[r] = seg.start_pos + item.t0 + r / group;
    }
  }

  // Keys `offset` .. offset + n - 1 of block `block` (KV head `kv_head`) as float rows of k and
  // v; rows n .. the next multiple of 8 are zero.
  void stage(int32_t block, int64_t offset, int64_t n, int64_t kv_head) {
    const KvLayout& L = a.layout;
    const int64_t key_stride = L.num_kv_heads * hd;
    const T* base = a.kv + block * L.block_stride() + a.layer * 2 * L.kind_stride() + offset * key_stride + kv_head * hd;
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = base + j * key_stride;
      const T* vr = kr + L.kind_stride();
      for (int64_t d = 0; d < hd; d += 8) {
        _mm256_storeu_ps(&k[j * hd + d], load8(kr + d));
        _mm256_storeu_ps(&v[j * hd + d], load8(vr + d));
      }
    }
    const int64_t padded = (n + 7) / 8 * 8;
    std::fill(k.begin() + n * hd, k.begin() + padded * hd, 0.0f);
    std::fill(v.begin() + n * hd, v.begin() + padded * hd, 0.0f);
  }

  // Row r over the chunk's keys key .. key + n - 1: its scores, one online-softmax step, and
  // s row r left holding its probabilities (0 where it may not look) and corr[r] the factor its
  // earlier sums are scaled by.
  void attend_scores(int64_t r, int64_t key, int64_t n) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t hi = std::min(n, pos[r] - key + 1);  // keys the row sees: [lo, hi)
    const int64_t lo = a.window ? std::max<int64_t>(0, pos[r] - a.window + 1 - key) : 0;
    float* sr = &s[r * kKeyChunk];
    const int64_t width = (n + 7) / 8 * 8;
    if (hi <= lo) {  // nothing here for this row: its sums stay as they are
      std::fill(sr, sr + width, 0.0f);
      corr[r] = 1.0f;
      return;
    }
    const float* qr = &q[r * hd];
    const __m256 scale = _mm256_set1_ps(a.scale), minus_inf = _mm256_set1_ps(neg_inf);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 top = minus_inf;
    for (int64_t j0 = 0; j0 < width; j0 += 8) {
      __m256 dots[8];
      for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 qd = _mm256_loadu_ps(qr + d);
        for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(&k[(j0 + j) * hd + d]), dots[j]);
      }
      const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(int(j0)), iota);
      const __m256i seen = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(hi)), index),
                                            _mm256_cmpgt_epi32(index, _mm256_set1_epi32(int(lo) - 1)));
      const __m256 x = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(sum_lanes8(dots), scale), _mm256_castsi256_ps(seen));
      _mm256_storeu_ps(sr + j0, x);
      top = _mm256_max_ps(top, x);
    }
    const float new_max = std::max(m[r], max8(top));
    corr[r] = m[r] == neg_inf ? 0.0f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[r] - new_max)));
    const __m256 shift = _mm256_set1_ps(new_max);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < width; j0 += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j0), shift));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(sr + j0, p);
    }
    l[r] = l[r] * corr[r] + sum8(sum);
    m[r] = new_max;
  }

  // o rows = o rows * corr + their probabilities times the chunk's V rows 0 .. n - 1.
  void weigh_values(int64_t rows, int64_t n) {
    int64_t r = 0;
    for (; r + kValueRows <= rows; r += kValueRows) weigh_rows<kValueRows>(r, n);
    switch (rows - r) {
      case 3: weigh_rows<3>(r, n); break;
      case 2: weigh_rows<2>(r, n); break;
      case 1: weigh_rows<1>(r, n); break;
      default: break;
    }
  }

  template <int NR>
  void weigh_rows(int64_t r, int64_t n) {
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
      __m256 acc[NR][2];
      for (int i = 0; i < NR; ++i) {
        const __m256 c = _mm256_set1_ps(corr[r + i]);
        acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(&o[(r + i) * hd + d0]), c);
        acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(&o[(r + i) * hd + d0 + 8]), c);
      }
      for (int64_t j = 0; j < n; ++j) {
        const __m256 v0 = _mm256_loadu_ps(&v[j * hd + d0]), v1 = _mm256_loadu_ps(&v[j * hd + d0 + 8]);
        for (int i = 0; i < NR; ++i) {
          const __m256 p = _mm256_broadcast_ss(&s[(r + i) * kKeyChunk + j]);
          acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
        }
      }
      for (int i = 0; i < NR; ++i) {
        _mm256_storeu_ps(&o[(r + i) * hd + d0], acc[i][0]);
        _mm256_storeu_ps(&o[(r + i) * hd + d0 + 8], acc[i][1]);
      }
    }
  }

  // Each row's output sums (rows of `sums`) over its softmax total (`totals`), rounded to T.
  void store(const WorkItem& item, const Segment& seg, int64_t rows, const float* sums, const float* totals) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = seg.q_start + item.t0 + r / group, head = item.kv_head * group + r % group;
      T* dst = a.out + token * a.num_heads * hd + head * hd;
      const __m256 inv = _mm256_set1_ps(totals[r] > 0.0f ? 1.0f / totals[r] : 0.0f);
      for (int64_t d = 0; d < hd; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(&sums[r * hd + d]), inv));
    }
  }
};

// The segments `ids` (all when empty); head_dim a multiple of 32 (the caller checks).
template <typename T>
void paged_attention(const AttentionArgs<T>& a, const std::vector<int32_t>& ids = {}) {
  std::vector<WorkItem> items;
  auto add = [&](int32_t s) {
    const int32_t len = a.segments[s].q_len, tile = int32_t(tiled(a.segments[s]) ? kPromptTile : kQueryTile);
    for (int32_t t0 = 0; t0 < len; t0 += tile)
      for (int32_t g = 0; g < int32_t(a.layout.num_kv_heads); ++g)
        items.push_back({s, t0, std::min<int32_t>(len, t0 + tile), g});
  };
  if (ids.empty())
    for (int32_t s = 0; s < a.num_segments; ++s) add(s);
  for (int32_t s : ids) add(s);
  // Later tiles of a long chunk see more keys: hand the costliest out first.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& x, const WorkItem& y) {
    return a.segments[x.segment].start_pos + x.t1 > a.segments[y.segment].start_pos + y.t1;
  });
  std::atomic<int64_t> next{0};
  const int64_t num_items = int64_t(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Avx2Attention<T> tile(a);
    for (int64_t i = next++; i < num_items; i = next++) tile.run(items[i]);
  });
}

}  // namespace pdserve
