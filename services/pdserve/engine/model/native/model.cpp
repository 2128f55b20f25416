// The whole decoder forward in one call: embedding, every layer, final norm and LM head, over a
// step's flattened tokens and the paged KV tensor. Python builds four small tensors per step
// (token ids, segments, block tables, logit rows); every per-layer operation runs here, with no
// Python between them. LoRA adapters' deltas are added to their own rows after each projection.
// The families' differences (decoder.py) are each layer's: q/k norms, Gemma's norms of the
// sublayers' outputs, its window, its rope variant, its MLP's activation and whether the MLP is a
// mixture of experts (moe.h: Mixtral, Qwen3-MoE); and the model's: the embedding's scale and the
// attention's score scale.
//
// The same file is built once per ISA level (setup.py): the level's kernels come from its
// folder, chosen by what the build enables.
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <tuple>
#include <utility>

#if defined(__AVX512F__)
#include "avx512/level.h"
#else
#include "avx2/level.h"
#endif
#include "avx2/panel_linear.h"
#include "head_norms.h"
#include "layer.h"
#include "lora.h"
#include "moe.h"  // after the level's kernels, which it calls
#include "onednn_linear.h"
#include "rope.h"

namespace pdserve {

template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
const T* optional_data(const at::Tensor& t) {  // null where undefined
  return t.defined() ? data<T>(t) : nullptr;
}

// Segments are read in place as `Segment` rows.
inline void check_segments(const at::Tensor& segments, const at::Tensor& tables) {
  TORCH_CHECK(segments.scalar_type() == at::kInt && tables.scalar_type() == at::kInt, "int32 segments and tables");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 4 && segments.is_contiguous(),
              "segments must be contiguous (S, 4): q_start, q_len, start_pos, prompt");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == segments.size(0) && tables.is_contiguous(),
              "one contiguous row of block ids per segment");
}

class NativeModel {
 public:
  NativeModel(at::Tensor embed, at::Tensor final_norm, at::Tensor lm_head, const std::vector<LayerSpec>& layers,
              const std::vector<RopeSpec>& ropes, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double eps, double attention_scale, c10::optional<double> embed_scale, bool packed,
              int64_t blocked_rows, const std::vector<c10::optional<MoeSpec>>& moe)
      : embed_(embed), final_norm_(final_norm), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), eps_(float(eps)), attention_scale_(float(attention_scale)), embed_scale_(embed_scale),
        packed_(packed), blocked_rows_(packed ? blocked_rows : 0) {
    TORCH_CHECK(embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16,
                "native kernels run float32 or bfloat16 weights");
    TORCH_CHECK(head_dim % 32 == 0 && embed.size(1) % 16 == 0, "native kernels need head_dim % 32 == 0");
    for (const auto& [inv_freq, long_inv_freq, long_from, factor] : ropes)
      ropes_.push_back(Rope{inv_freq.contiguous(), long_inv_freq.value_or(at::Tensor()), long_from, factor});
    for (const LayerSpec& spec : layers) layers_.push_back(layer_of(spec));
    TORCH_CHECK(moe.empty() || moe.size() == layers.size(), "a mixture (or None) per layer, or none at all");
    auto make = [this](const at::Tensor& w, int64_t columns) { return matrix(w, columns); };
    for (size_t i = 0; i < moe.size(); ++i) {
      TORCH_CHECK(!moe[i] || !layers_[i].mlp_out_norm.defined(), "a mixture's output is not normed");
      moe_.push_back(moe[i] ? std::optional<Moe>(moe_of(*moe[i], embed.size(1), make)) : std::nullopt);
    }
    lm_head_ = matrix(lm_head, embed.size(0));
  }

  // token_ids (T,) int64; segments (S, 4) int32 [q_start, q_len, start_pos, prompt]; tables (S, W)
  // int32; logit_rows (R,) int64; kv (N, L, 2, tpb, kvh, hd); lora: the step's rows by adapter.
  // Returns float32 logits (R, V).
  at::Tensor forward(const at::Tensor& token_ids, const at::Tensor& segments, const at::Tensor& tables,
                     const at::Tensor& logit_rows, const at::Tensor& kv, const std::vector<LoraGroup>& lora) {
    check_step(segments, tables, kv, lora);
    if (embed_.scalar_type() == at::kBFloat16) return run<bf16>(token_ids, segments, tables, logit_rows, kv, lora);
    return run<float>(token_ids, segments, tables, logit_rows, kv, lora);
  }

  // `forward`, also returning hidden states of every token (a drafter's: EAGLE, MTP): the final
  // normed one where `final` (T, H), and the residual stream entering each of `layers`, side by
  // side (T, len(layers) * H); undefined (None) where not asked. The logits are `forward`'s bits.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_hidden(
      const at::Tensor& token_ids, const at::Tensor& segments, const at::Tensor& tables, const at::Tensor& logit_rows,
      const at::Tensor& kv, const std::vector<LoraGroup>& lora, const std::vector<int64_t>& layers, bool final) {
    for (int64_t layer : layers)
      TORCH_CHECK(layer >= 0 && layer < int64_t(layers_.size()), "no layer ", layer, " to capture");
    Capture capture{layers, final, at::Tensor(), at::Tensor()};
    if (!layers.empty()) capture.inputs = at::empty({token_ids.size(0), int64_t(layers.size()) * embed_.size(1)},
                                                    embed_.options());
    check_step(segments, tables, kv, lora);
    at::Tensor logits = embed_.scalar_type() == at::kBFloat16
                            ? run<bf16>(token_ids, segments, tables, logit_rows, kv, lora, &capture)
                            : run<float>(token_ids, segments, tables, logit_rows, kv, lora, &capture);
    return {logits, capture.final_hidden, capture.inputs};
  }

  // A one-element int32 tensor that another thread may change while a step runs: each layer
  // (and the LM head) starts on that many torch threads (a worker borrowing a core its peer left
  // idle mid-step, `worker/cpu/core_share.py`). Without one, a step keeps the caller's count.
  void follow_threads(const at::Tensor& source) {
    TORCH_CHECK(source.scalar_type() == at::kInt && source.numel() == 1 && source.is_contiguous(),
                "the thread count to follow is a one-element int32 tensor");
    threads_ = source;
  }

  // x (M, K) . w (N, K)^T + bias + residual, through the same dispatch the layers use (`columns`:
  // N where w is panels).
  at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                    const c10::optional<at::Tensor>& residual, c10::optional<int64_t> columns) const {
    const Matrix m = matrix(w, columns.value_or(w.size(0)));
    return linear_(x.contiguous(), m, bias.value_or(at::Tensor()), residual.value_or(at::Tensor()));
  }

 private:
  void check_step(const at::Tensor& segments, const at::Tensor& tables, const at::Tensor& kv,
                  const std::vector<LoraGroup>& lora) const {
    TORCH_CHECK(kv.scalar_type() == embed_.scalar_type(), "KV dtype must equal the weights' dtype");
    check_segments(segments, tables);
    for (const auto& [rows, weights] : lora)
      TORCH_CHECK(weights && weights->layers.size() == layers_.size(), "a LoRA adapter of ", layers_.size(),
                  " layers");
  }

  // The hidden states a step hands back (`forward_hidden`), filled as the layers run.
  struct Capture {
    std::vector<int64_t> layers;  // the residual stream entering each, in this order
    bool final;                   // the final normed hidden state
    at::Tensor inputs;            // (T, len(layers) * H)
    at::Tensor final_hidden;      // (T, H)
  };

  template <typename T>
  at::Tensor run(const at::Tensor& token_ids, const at::Tensor& segments, const at::Tensor& tables,
                 const at::Tensor& logit_rows, const at::Tensor& kv, const std::vector<LoraGroup>& lora,
                 Capture* capture = nullptr) {
    const int64_t num_layers = kv.size(1), tpb = kv.size(3);
    TORCH_CHECK(num_layers == int64_t(layers_.size()), "KV tensor has ", num_layers, " layers");
    at::Tensor positions = at::empty({token_ids.size(0)}, at::kLong);
    at::Tensor token_rows = at::empty_like(positions);
    fill_rows(segments, tables, num_layers, tpb, data<int64_t>(positions), data<int64_t>(token_rows));
    std::vector<std::pair<at::Tensor, at::Tensor>> rotations;  // (cos, signed sin) (T, hd) per rope variant
    for (const Rope& rope : ropes_) rotations.push_back(cos_sin(rope, positions, embed_.scalar_type()));
    at::Tensor h = embed_.index_select(0, token_ids);  // (T, H)
    if (embed_scale_) h.mul_(*embed_scale_);  // as decoder.py scales (Gemma), the factor already in the dtype's steps
    const int64_t hidden = embed_.size(1);
    for (int64_t i = 0; i < num_layers; ++i) {
      follow_thread_count();
      const auto& [cos, sin] = rotations[layers_[i].rope];
      for (size_t j = 0; capture && j < capture->layers.size(); ++j)
        if (capture->layers[j] == i) capture->inputs.narrow(1, int64_t(j) * hidden, hidden).copy_(h);
      h = layer<T>(layers_[i], i, h, cos, sin, token_rows, segments, tables, kv, lora);
    }
    if (capture && capture->final) capture->final_hidden = norm<T>(h, final_norm_);
    if (logit_rows.size(0) == 0) return at::empty({0, embed_.size(0)}, at::kFloat);
    follow_thread_count();
    at::Tensor last = norm<T>(h.index_select(0, logit_rows), final_norm_);
    return linear_(last, lm_head_, at::Tensor(), at::Tensor()).to(at::kFloat);
  }

  template <typename T>
  at::Tensor layer(const Layer& w, int64_t index, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& token_rows, const at::Tensor& segments, const at::Tensor& tables,
                   const at::Tensor& kv, const std::vector<LoraGroup>& lora) {
    const int64_t tokens = h.size(0), kvh = num_kv_heads_, hd = head_dim_;
    const at::Tensor x = norm<T>(h, w.input_norm);
    at::Tensor qkv = linear_(x, w.qkv, w.qkv_bias, at::Tensor());  // (T, (nh + 2 kvh) hd)
    add_lora(qkv, x, lora, index, kQkv);
    const HeadNorms<T> norms{optional_data<T>(w.q_norm), optional_data<T>(w.k_norm), eps_};
    rope_and_store<T>(data<T>(qkv), tokens, num_heads_, kvh, hd, data<T>(cos), data<T>(sin), data<T>(kv), index,
                      kv.size(3), data<int64_t>(token_rows), norms);
    at::Tensor attn = attention<T>(qkv, index, w.window, segments, tables, kv);
    at::Tensor h2 = residual_plus<T>(attn, w.o_proj, w.o_bias, w.attn_out_norm, h, lora, index, kOProj);
    const at::Tensor x2 = norm<T>(h2, w.post_norm);
    if (index < int64_t(moe_.size()) && moe_[index]) {  // no adapters there (lora.py refuses them)
      auto product = [this](const at::Tensor& x, const Matrix& m) { return linear_(x, m, at::Tensor(), at::Tensor()); };
      return h2 + moe_mlp<T>(*moe_[index], x2, w.activation, product);
    }
    at::Tensor gate_up = linear_(x2, w.gate_up, w.gate_up_bias, at::Tensor());
    add_lora(gate_up, x2, lora, index, kGateUp);
    const int64_t inter = gate_up.size(1) / 2;
    at::Tensor act = at::empty({tokens, inter}, h.options());
    gated_activation<T>(data<T>(gate_up), tokens, inter, w.activation, data<T>(act));
    return residual_plus<T>(act, w.down, w.down_bias, w.mlp_out_norm, h2, lora, index, kDown);
  }

  // residual + x . w^T + bias, or residual + out_norm(x . w^T + bias) where the layer norms its
  // sublayer's output (Gemma). The residual is fused into the product unless something comes
  // between: an adapter's deltas on this projection, or the norm (then added after them,
  // rounding where the torch path rounds).
  template <typename T>
  at::Tensor residual_plus(const at::Tensor& x, const Matrix& w, const at::Tensor& bias, const at::Tensor& out_norm,
                           const at::Tensor& residual, const std::vector<LoraGroup>& lora, int64_t layer,
                           Projection p) const {
    if (!out_norm.defined() && !has_lora(lora, layer, p)) return linear_(x, w, bias, residual);
    at::Tensor y = linear_(x, w, bias, at::Tensor());
    add_lora(y, x, lora, layer, p);
    if (!out_norm.defined()) return residual + y;
    at::Tensor out = at::empty_like(y);
    rms_norm_add<T>(data<T>(y), y.size(0), y.size(1), data<T>(out_norm), eps_, data<T>(residual), data<T>(out));
    return out;
  }

  // In float32 (where kFlashFloatPrompts), chunks that start a sequence (no cached prefix, no
  // window) go to torch's flash attention over their own q, k, v, which beats the float paged
  // kernel on long prompts; in bf16 the packed tile kernel beats both, so every chunk reads the
  // paged KV in place.
  template <typename T>
  at::Tensor attention(const at::Tensor& qkv, int64_t layer, int64_t window, const at::Tensor& segments,
                       const at::Tensor& tables, const at::Tensor& kv) const {
    const int64_t hd = head_dim_, kvh = num_kv_heads_, nh = num_heads_;
    const float scale = attention_scale_;
    at::Tensor attn = at::empty({qkv.size(0), nh * hd}, qkv.options());
    const Segment* segs = reinterpret_cast<const Segment*>(segments.data_ptr());
    std::vector<int32_t> paged;
    for (int32_t s = 0; s < segments.size(0); ++s) {
      if (!kFlashFloatPrompts || std::is_same_v<T, bf16> || segs[s].start_pos != 0 || window != 0 ||
          segs[s].q_len < kQueryTile) {
        paged.push_back(s);
        continue;
      }
      at::Tensor rows = qkv.narrow(0, segs[s].q_start, segs[s].q_len);  // (t, (nh + 2 kvh) hd)
      auto heads = [&](int64_t first, int64_t n) {  // (1, n, t, hd)
        return rows.narrow(1, first * hd, n * hd).view({rows.size(0), n, hd}).transpose(0, 1).unsqueeze(0);
      };
      at::Tensor out = at::scaled_dot_product_attention(heads(0, nh), heads(nh, kvh), heads(nh + kvh, kvh), {}, 0.0,
                                                        true, scale, true);  // (1, nh, t, hd)
      attn.narrow(0, segs[s].q_start, segs[s].q_len).view({rows.size(0), nh, hd}).copy_(out[0].transpose(0, 1));
    }
    if (!paged.empty()) {
      AttentionArgs<T> args{data<T>(qkv), qkv.size(1), nh, data<T>(kv), KvLayout{kv.size(1), kv.size(3), kvh, hd},
                            layer, segs, segments.size(0), data<int32_t>(tables), tables.size(1), scale, window,
                            data<T>(attn)};
      paged_attention<T>(args, paged);
    }
    return attn;
  }

  template <typename T>
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const {
    at::Tensor out = at::empty_like(x);
    rms_norm<T>(data<T>(x), x.size(0), x.size(1), data<T>(weight), eps_, data<T>(out));
    return out;
  }

  // Panels (bf16 where the CPU has no bf16 products) go to `panel_linear`; oneDNN-packed weights
  // (bf16) to oneDNN's kernel with the residual fused, or, for a step of at most `blocked_rows_`
  // rows, to `blocked_linear` on the same bytes; plain ones (float32) to `at::linear`.
  at::Tensor linear_(const at::Tensor& x, const Matrix& w, const at::Tensor& bias, const at::Tensor& residual) const {
    if (is_panels(w.w)) return panel_linear(x, w.w, w.columns, bias, residual);
    if (w.blocked && x.size(0) <= blocked_rows_) return blocked_linear(x, w.blocked, w.columns, bias, residual);
    if (packed_) return packed_linear(x, w.w, bias, residual);
    at::Tensor y = at::linear(x, w.w, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
    return residual.defined() ? residual + y : y;
  }

  Layer layer_of(const LayerSpec& spec) const {
    const auto& [w, window, rope, activation] = spec;
    TORCH_CHECK(w.size() == kLayerSlots, "a layer has ", kLayerSlots, " weight slots");
    TORCH_CHECK(rope >= 0 && rope < int64_t(ropes_.size()), "rope ", rope, " of ", ropes_.size());
    TORCH_CHECK(!window || *window > 0, "a window is a positive count of keys");
    auto get = [&](int i) {  // packed weights are opaque oneDNN tensors, kept as they are
      if (!w[i].has_value()) return at::Tensor();
      return w[i]->layout() == at::kStrided ? w[i]->contiguous() : *w[i];
    };
    Layer layer{get(0), get(2), get(3), get(4), get(6), get(7), get(8), get(10), get(12), get(13)};
    TORCH_CHECK(layer.q_norm.defined() == layer.k_norm.defined(), "q and k heads are normed both or neither");
    const int64_t hidden = embed_.size(1), qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
    if (w[11]) layer.down = matrix(get(11), hidden);  // absent where the layer is a mixture (moe_)
    layer.qkv = matrix(get(1), qkv_width);
    layer.o_proj = matrix(get(5), hidden);
    if (w[9]) layer.gate_up = matrix(get(9), 2 * layer.down.w.size(1));
    layer.window = window.value_or(0);
    layer.rope = rope;
    layer.activation = activation_named(activation);
    return layer;
  }

  // `w` with its width and, where `blocked_linear` may read it (packed weights only, when the
  // Python side found oneDNN's layout the one it reads: `blocked_rows` > 0), its bytes.
  Matrix matrix(const at::Tensor& w, int64_t columns) const {
    Matrix m{w, is_panels(w) ? columns : w.size(0), nullptr};
    TORCH_CHECK(!is_panels(w) || (columns > (w.size(0) - 1) * kPanelColumns && columns <= w.size(0) * kPanelColumns),
                "panels of ", w.size(0) * kPanelColumns, " columns for a matrix of ", columns);
    const bool fits = w.layout() != at::kStrided && w.size(0) % kBlockColumns == 0 && w.size(1) % 2 == 0;
    if (blocked_rows_ > 0 && fits) m.blocked = packed_data(w);
    return m;
  }

  void follow_thread_count() const {
    if (!threads_.defined()) return;
    const int want = __atomic_load_n(data<int32_t>(threads_), __ATOMIC_RELAXED);
    if (want > 0 && want != at::get_num_threads()) at::set_num_threads(want);
  }

  static void fill_rows(const at::Tensor& segments, const at::Tensor& tables, int64_t num_layers, int64_t tpb,
                        int64_t* positions, int64_t* token_rows) {
    const Segment* segs = reinterpret_cast<const Segment*>(segments.data_ptr());
    const int32_t* table = data<int32_t>(tables);
    for (int64_t s = 0; s < segments.size(0); ++s) {
      for (int32_t i = 0; i < segs[s].q_len; ++i) {
        const int64_t t = segs[s].q_start + i, pos = segs[s].start_pos + i;
        positions[t] = pos;
        token_rows[t] = int64_t(table[s * tables.size(1) + pos / tpb]) * num_layers * 2 * tpb + pos % tpb;
      }
    }
  }

  at::Tensor embed_, final_norm_;
  Matrix lm_head_;
  at::Tensor threads_;  // undefined: no thread count to follow
  std::vector<Layer> layers_;
  std::vector<std::optional<Moe>> moe_;  // per layer, where its MLP is a mixture of experts (or empty)
  std::vector<Rope> ropes_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  float eps_, attention_scale_;
  c10::optional<double> embed_scale_;
  bool packed_;
  int64_t blocked_rows_;  // steps of at most this many rows read packed weights with `blocked_linear`
};

// q (T, >= nh * hd) rows (q heads first), kv (N, L, 2, tpb, kvh, hd) -> (T, nh * hd).
at::Tensor attention(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& segments,
                     const at::Tensor& tables, int64_t num_heads, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && q.stride(1) == 1, "q must be row-major in the KV dtype");
  check_segments(segments, tables);
  const int64_t hd = kv.size(5);
  at::Tensor out = at::empty({q.size(0), num_heads * hd}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    AttentionArgs<T> args{data<T>(q), q.stride(0), num_heads, data<T>(kv), KvLayout{kv.size(1), kv.size(3), kv.size(4), hd},
                          layer, reinterpret_cast<const Segment*>(segments.data_ptr()), segments.size(0),
                          data<int32_t>(tables), tables.size(1), float(scale), window, data<T>(out)};
    pybind11::gil_scoped_release release;
    paged_attention<T>(args);
  };
  if (q.scalar_type() == at::kBFloat16) run(bf16{}); else run(float{});
  return out;
}

}  // namespace pdserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.attr("LEVEL") = pdserve::kLevel;
  m.def("attention", &pdserve::attention);
  m.def("blocked_layout", &pdserve::blocked_layout);
  m.def("use_amx_attention", &pdserve::use_amx_attention);
  m.def("to_panels", &pdserve::to_panels);
  // module_local: every level's build (and the just-in-time one) defines these same C++ types, and
  // one process may load several (tests force each level in turn); pybind11 would refuse the
  // second registration of a type shared across modules.
  py::class_<pdserve::LoraWeights, std::shared_ptr<pdserve::LoraWeights>>(m, "LoraWeights", py::module_local())
      .def(py::init<const std::vector<std::vector<c10::optional<std::vector<at::Tensor>>>>&>());
  py::class_<pdserve::NativeModel>(m, "NativeModel", py::module_local())
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, const std::vector<pdserve::LayerSpec>&,
                    const std::vector<pdserve::RopeSpec>&, int64_t, int64_t, int64_t, double, double,
                    c10::optional<double>, bool, int64_t, const std::vector<c10::optional<pdserve::MoeSpec>>&>(),
           py::arg("embed"), py::arg("final_norm"), py::arg("lm_head"), py::arg("layers"), py::arg("ropes"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("attention_scale"), py::arg("embed_scale"), py::arg("packed"), py::arg("blocked_rows"),
           py::arg("moe") = std::vector<c10::optional<pdserve::MoeSpec>>())
      .def("forward", &pdserve::NativeModel::forward, py::arg("token_ids"), py::arg("segments"), py::arg("tables"),
           py::arg("logit_rows"), py::arg("kv"), py::arg("lora") = std::vector<pdserve::LoraGroup>(),
           py::call_guard<py::gil_scoped_release>())
      .def("forward_hidden", &pdserve::NativeModel::forward_hidden, py::arg("token_ids"), py::arg("segments"),
           py::arg("tables"), py::arg("logit_rows"), py::arg("kv"), py::arg("lora"), py::arg("layers"),
           py::arg("final"), py::call_guard<py::gil_scoped_release>())
      .def("follow_threads", &pdserve::NativeModel::follow_threads)
      .def("linear", &pdserve::NativeModel::linear, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("residual"),
           py::arg("columns") = c10::optional<int64_t>(), py::call_guard<py::gil_scoped_release>());
}
