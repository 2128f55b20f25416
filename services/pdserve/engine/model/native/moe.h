// The mixture-of-experts MLP (Mixtral, Qwen3-MoE) of a layer, as engine/model/moe.py computes it:
// the router's product, a float32 softmax and top-k per token (renormalised where the family
// does), then the step's (token, slot) pairs sorted by expert so that each chosen expert runs
// its gate|up and down products once, over all its rows together, through the layer's own
// product dispatch (`linear`: panels, oneDNN or at::linear, as the dense matrices). Each token's
// output is its rows' weighted sum, added in ascending expert order and rounded as moe.py's
// index_add rounds.
//
//   sorted rows (T k, H): | expert 0's tokens | expert 1's tokens | ... |   (counts[e] rows each)
//
// Routing runs ATen's softmax and topk, as the torch path does, so both choose the same experts.
// Its weights scale an expert's output in float32 before the rounding (Mixtral) or are rounded
// to the model's dtype first (Qwen3-MoE: `weights_in_float32` false), as transformers does.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "activation.h"
#include "bf16.h"
#include "layer.h"

namespace pdserve {

// A mixture as Python hands it over (native_forward.py): the router (E, H) and each expert's
// gate|up (2I, H) and down (H, I) in the form the layer's matrices take, top_k, whether the
// top-k weights are renormalised, and whether they scale in float32.
using MoeSpec = std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, bool, bool>;

struct Moe {
  Matrix router;
  std::vector<Matrix> gate_up, down;
  int64_t top_k = 1;
  bool normalize = true, weights_in_float32 = true;
};

// The mixture of `spec` with its matrices made by `matrix(tensor, columns)` (the model's own
// `matrix`), for a layer of width `hidden`.
template <typename MakeMatrix>
Moe moe_of(const MoeSpec& spec, int64_t hidden, const MakeMatrix& matrix) {
  const auto& [router, gate_up, down, top_k, normalize, weights_in_float32] = spec;
  const int64_t experts = int64_t(gate_up.size());
  TORCH_CHECK(experts > 0 && int64_t(down.size()) == experts, "a mixture has a gate|up and a down per expert");
  TORCH_CHECK(top_k > 0 && top_k <= experts, "top_k ", top_k, " of ", experts, " experts");
  auto held = [](const at::Tensor& w) { return w.layout() == at::kStrided ? w.contiguous() : w; };  // packed: as is
  Moe moe{matrix(held(router), experts), {}, {}, top_k, normalize, weights_in_float32};
  for (int64_t e = 0; e < experts; ++e) {
    moe.down.push_back(matrix(held(down[e]), hidden));
    moe.gate_up.push_back(matrix(held(gate_up[e]), 2 * moe.down.back().w.size(1)));
  }
  return moe;
}

// A step's (token, slot) pairs sorted by expert (stable: by token within an expert).
struct Routes {
  std::vector<int64_t> counts;   // (E,) rows of each expert
  std::vector<int64_t> tokens;   // (T k,) the token of each sorted row
  std::vector<int64_t> rows_of;  // (T k,) token t's sorted rows at [t k, (t + 1) k), ascending (by expert)
  at::Tensor weights;            // (T k,) float32, each sorted row's routing weight
};

// logits (T, E) in the model's dtype -> the routes of its top_k experts per token.
inline Routes route(const at::Tensor& logits, int64_t top_k, bool normalize) {
  const int64_t tokens = logits.size(0), experts = logits.size(1), pairs = tokens * top_k;
  at::Tensor probs = at::softmax(logits, -1, at::kFloat);  // (T, E)
  auto [weights, chosen] = at::topk(probs, top_k, -1);     // (T, k) each
  if (normalize) weights.div_(weights.sum(-1, true));
  chosen = chosen.contiguous();
  const int64_t* expert = chosen.data_ptr<int64_t>();
  Routes r{std::vector<int64_t>(experts, 0), std::vector<int64_t>(pairs), std::vector<int64_t>(pairs), {}};
  for (int64_t i = 0; i < pairs; ++i) ++r.counts[expert[i]];
  std::vector<int64_t> next(experts, 0);  // each expert's first free sorted row
  for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + r.counts[e - 1];
  std::vector<int64_t> order(pairs);  // sorted row -> flat (token k + slot) index
  for (int64_t i = 0; i < pairs; ++i) order[next[expert[i]]++] = i;
  std::vector<int64_t> slot(tokens, 0);
  for (int64_t row = 0; row < pairs; ++row) {  // rows ascend, so each token's rows do too
    const int64_t t = order[row] / top_k;
    r.tokens[row] = t;
    r.rows_of[t * top_k + slot[t]++] = row;
  }
  r.weights = weights.reshape({pairs}).index_select(0, at::tensor(order));
  return r;
}

// y[t] = sum over token t's rows of round(out[row] * weight[row]), summed in the dtype T from 0
// in ascending row order (moe.py's index_add into zeros); `rows[row]` is that row's output (H,).
template <typename T>
void combine(const Routes& r, const std::vector<const T*>& rows, int64_t top_k, bool weights_in_float32,
             int64_t hidden, T* y) {
  const float* weight = r.weights.data_ptr<float>();
  const int64_t tokens = int64_t(r.tokens.size()) / top_k;
  at::parallel_for(0, tokens, 4, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      T* out = y + t * hidden;
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t row = r.rows_of[t * top_k + j];
        const float w = weights_in_float32 ? weight[row] : rounded<T>(weight[row]);
        const T* x = rows[row];
        for (int64_t h = 0; h < hidden; ++h) {
          const float term = rounded<T>(to_float(x[h]) * w);
          out[h] = from_float<T>(j == 0 ? term : to_float(out[h]) + term);
        }
      }
    }
  });
}

// Expert e's rows [first, first + n) of `sorted` through its gate|up, activation and down.
template <typename T, typename Linear>
at::Tensor run_expert(const Moe& moe, int64_t e, const at::Tensor& sorted, int64_t first, int64_t n,
                      Activation activation, const Linear& linear) {
  const at::Tensor gate_up = linear(sorted.narrow(0, first, n), moe.gate_up[e]);  // (n, 2I)
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor act = at::empty({n, inter}, sorted.options());
  gated_activation<T>(reinterpret_cast<const T*>(gate_up.data_ptr()), n, inter, activation,
                      reinterpret_cast<T*>(act.data_ptr()));
  return linear(act, moe.down[e]).contiguous();  // (n, H)
}

// x (T, H) -> the mixture's output (T, H), without the residual. `linear(x, matrix)` is the
// layer's product; `activation` the experts' (the layer's) gated activation. Where at least as
// many experts run as there are threads, each thread takes whole experts (their products then
// run on one thread each: one parallel region for all, where each expert's own products would
// open five, and a step of few rows per expert spends more on those than on its products);
// otherwise the experts run one after another, each on every thread.
template <typename T, typename Linear>
at::Tensor moe_mlp(const Moe& moe, const at::Tensor& x, Activation activation, const Linear& linear) {
  const int64_t hidden = x.size(1);
  const Routes r = route(linear(x, moe.router), moe.top_k, moe.normalize);
  const at::Tensor sorted = x.index_select(0, at::tensor(r.tokens));  // (T k, H)
  std::vector<int64_t> chosen, firsts;  // the experts with rows, and where their rows start
  for (int64_t e = 0, first = 0; e < int64_t(r.counts.size()); first += r.counts[e++])
    if (r.counts[e]) chosen.push_back(e), firsts.push_back(first);
  std::vector<at::Tensor> outputs(chosen.size());  // each chosen expert's (count, H), kept until combined
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      outputs[i] = run_expert<T>(moe, chosen[i], sorted, firsts[i], r.counts[chosen[i]], activation, linear);
  };
  if (int64_t(chosen.size()) >= at::get_num_threads()) at::parallel_for(0, int64_t(chosen.size()), 1, run);
  else run(0, int64_t(chosen.size()));
  std::vector<const T*> rows(r.tokens.size());
  for (size_t i = 0; i < chosen.size(); ++i) {
    const T* out = reinterpret_cast<const T*>(outputs[i].data_ptr());
    for (int64_t j = 0; j < r.counts[chosen[i]]; ++j) rows[firsts[i] + j] = out + j * hidden;
  }
  at::Tensor y = at::empty_like(x);
  combine<T>(r, rows, moe.top_k, moe.weights_in_float32, hidden, reinterpret_cast<T*>(y.data_ptr()));
  return y;
}

}  // namespace pdserve
