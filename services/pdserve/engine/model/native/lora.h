// LoRA adapters on the native path: each adapter's low-rank pairs per layer and fused projection,
// held once (`LoraWeights`, built when the adapter loads), and a step's groups of rows by adapter.
// After a projection y = x . W^T, every group adds its delta to its own rows:
//
//     y[rows] += (x[rows] . A^T) . B^T        (all rows: one addmm)
//
// A float32 model's deltas run through the same torch ops as the torch path
// (`engine/model/lora.py`, `LoraStep.add`). A bf16 model's pairs are held as float32 and its
// deltas computed in float32, rounded once as they are added: torch's bf16 products take a slow
// generic path where the CPU has no AVX-512 BF16 (on AVX2, one adapter in a batch kept 0.49x of
// the decode throughput with LoRA off through bf16 products, 0.80x through these; benchmarks/README.md).
#pragma once
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace pdserve {

enum Projection { kQkv = 0, kOProj = 1, kGateUp = 2, kDown = 3 };

struct LoraWeights {
  // layers[i][projection]: (A (r, in), B (out, r)), or none where the adapter leaves it alone
  std::vector<std::vector<std::optional<std::pair<at::Tensor, at::Tensor>>>> layers;

  explicit LoraWeights(const std::vector<std::vector<c10::optional<std::vector<at::Tensor>>>>& pairs) {
    for (const auto& layer : pairs) {
      TORCH_CHECK(layer.size() == 4, "an adapter layer has 4 projection slots: qkv, o_proj, gate_up, down");
      auto& slots = layers.emplace_back();
      for (const auto& pair : layer) {
        if (!pair.has_value()) {
          slots.emplace_back();
          continue;
        }
        TORCH_CHECK(pair->size() == 2 && (*pair)[0].dim() == 2 && (*pair)[1].dim() == 2 &&
                        (*pair)[0].size(0) == (*pair)[1].size(1),
                    "a LoRA pair is (A (r, in), B (out, r))");
        slots.emplace_back(std::make_pair((*pair)[0].to(at::kFloat).contiguous(), (*pair)[1].to(at::kFloat).contiguous()));
      }
    }
  }
};

// One adapter's rows of a step: `rows` (R,) int64, undefined when it has every row.
using LoraGroup = std::pair<c10::optional<at::Tensor>, std::shared_ptr<LoraWeights>>;

inline bool has_lora(const std::vector<LoraGroup>& groups, int64_t layer, Projection p) {
  for (const auto& [rows, weights] : groups)
    if (weights->layers[layer][p].has_value()) return true;
  return false;
}

// y (T, out) += every group's delta of x (T, in) for `layer`'s projection p, in place.
inline void add_lora(at::Tensor& y, const at::Tensor& x, const std::vector<LoraGroup>& groups, int64_t layer,
                     Projection p) {
  const bool is_float = x.scalar_type() == at::kFloat;
  for (const auto& [rows, weights] : groups) {
    const auto& pair = weights->layers[layer][p];
    if (!pair.has_value()) continue;
    const auto& [a, b] = *pair;
    const at::Tensor xs = rows.has_value() ? x.index_select(0, *rows) : x;
    const at::Tensor xf = is_float ? xs : xs.to(at::kFloat);
    if (!rows.has_value() && is_float)
      y.addmm_(at::linear(xf, a), b.t());
    else if (!rows.has_value())
      y.add_(at::linear(at::linear(xf, a), b));  // one rounding to y's dtype
    else
      y.index_add_(0, *rows, at::linear(at::linear(xf, a), b).to(y.scalar_type()));
  }
}

}  // namespace pdserve
