// What paged attention reads, the same at every ISA level: the block-major KV tensor's layout,
// a step's segments (one sequence's chunk each) and the arguments of one call.
//
//   kv tensor (num_blocks, L, 2, tpb, kvh, hd); a segment is one sequence's chunk:
//   | start_pos tokens already in KV | q_len new tokens (their K/V already written) |
//   query token i sits at position start_pos + i and sees keys 0 .. start_pos + i
//   (and only the last `window` of them when a sliding window is set).
#pragma once
#include <cstdint>

namespace pdserve {

struct KvLayout {
  int64_t num_layers, tokens_per_block, num_kv_heads, head_dim;
  int64_t kind_stride() const { return tokens_per_block * num_kv_heads * head_dim; }
  int64_t block_stride() const { return num_layers * 2 * kind_stride(); }
};

struct Segment {
  int32_t q_start, q_len, start_pos;
  int32_t prompt;  // 1: prompt tokens
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

}  // namespace pdserve
