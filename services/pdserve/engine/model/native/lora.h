// LoRA adapters on the native path: each adapter's low-rank pairs per layer and fused projection,
// held once (`LoraWeights`, built when the adapter loads), and a step's groups of rows by adapter.
// After a projection y = x . W^T, every group adds its delta to its own rows, in the model's dtype
// and through the same torch ops as the torch path (`engine/model/lora.py`, `LoraStep.add`):
//
//     y[rows] += (x[rows] . A^T) . B^T        (all rows: one addmm)
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
        slots.emplace_back(std::make_pair((*pair)[0].contiguous(), (*pair)[1].contiguous()));
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
  for (const auto& [rows, weights] : groups) {
    const auto& pair = weights->layers[layer][p];
    if (!pair.has_value()) continue;
    const auto& [a, b] = *pair;
    if (!rows.has_value())
      y.addmm_(at::linear(x, a), b.t());
    else
      y.index_add_(0, *rows, at::linear(at::linear(x.index_select(0, *rows), a), b));
  }
}

}  // namespace pdserve
