// Chains of the extension's decode-step ops, each chain one call from Python.
//
// At batch 1 a decode step streams a few hundred MB of weights in ~60 native calls, and the
// interpreter runs between every two of them (argument checks, wrapper functions, torch dispatch,
// the MoE block's store, prefetcher and statistics hooks) with caches the weight stream has just
// flushed: that time is spent with no weight moving. The chains below run the very same kernels in
// the same order with the same arguments as the calls they replace (so their results are
// bit-identical, tests/kernels/test_step_ops.py::test_decode_chains_are_the_ops_one_by_one), only without
// returning to Python in between. The longest, DecodeLayers, is all of a step's layers.

#include "ops.h"
#include "distinct_experts.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>

namespace {

// A decode step's attention sub-layer, from the input norm's output x to the next norm's:
//   qkv = x @ qkv_w.T (+ qkv_b); attention (decode_attention_block); h += attention @ o_w.T;
//   returns RMSNorm(h) with post_norm. h [B, hidden] is updated in place, as add_rms_norm does.
torch::Tensor decode_attention_sublayer(torch::Tensor h, torch::Tensor x, torch::Tensor qkv_w,
                                        c10::optional<torch::Tensor> qkv_b, c10::optional<torch::Tensor> q_norm,
                                        c10::optional<torch::Tensor> k_norm, double eps, torch::Tensor cos,
                                        torch::Tensor sin, torch::Tensor positions, torch::Tensor k, torch::Tensor v,
                                        torch::Tensor slots, torch::Tensor blocks, torch::Tensor lens,
                                        int64_t block_size, double scale, int64_t window, int64_t num_heads,
                                        torch::Tensor o_w, torch::Tensor post_norm) {
  auto qkv = dense_linear(x, qkv_w, qkv_b);
  auto attention = decode_attention_block(qkv, q_norm, k_norm, eps, cos, sin, positions, k, v, slots, blocks, lens,
                                          block_size, scale, window, num_heads);
  return add_rms_norm(h, dense_linear(attention, o_w, c10::nullopt), post_norm, eps);
}

// A softmax router of few rows: logits = x @ router_w.T, torch's own softmax over them, then
// route_topk. Returns (top-k weights, top-k expert ids).
std::vector<torch::Tensor> route_decode(torch::Tensor x, torch::Tensor router_w, int64_t k, bool renormalize) {
  return route_topk(at::softmax(dense_linear(x, router_w, c10::nullopt), -1), k, renormalize);
}

// Every layer of a decode step in one call, for a model whose layers are all MoE layers with their
// experts resident (nothing for an expert store or a prefetcher to do between layers). Per layer:
// the attention sub-layer chain, the router chain, fused_moe, then h += the MoE output and the next
// RMSNorm (the next layer's input norm; after the last layer, the final norm) by add_rms_norm; then,
// where one is given, the LM head.
// The weights are taken (and checked, and converted to what the kernels read) once, at construction;
// a step passes what changes: the token ids, the batch's index tensors, the RoPE tables (they grow)
// and the K/V caches. A step's activations live in a workspace kept per batch size, and the ops
// run through their `_into` cores (cpu_common.h): between the step's first checks and its returned
// tensors no tensor is made and nothing is dispatched but torch's softmax, into the workspace.
class DecodeLayers {
 public:
  DecodeLayers(std::vector<torch::Tensor> qkv_w, std::vector<c10::optional<torch::Tensor>> qkv_b,
               std::vector<c10::optional<torch::Tensor>> q_norm, std::vector<c10::optional<torch::Tensor>> k_norm,
               std::vector<torch::Tensor> o_w, std::vector<torch::Tensor> post_norm, std::vector<torch::Tensor> router,
               std::vector<torch::Tensor> w13, std::vector<torch::Tensor> w2, std::vector<torch::Tensor> next_norm,
               double eps, double scale, int64_t window, int64_t num_heads, int64_t top_k, bool renormalize,
               torch::Tensor embed, torch::Tensor first_norm, c10::optional<torch::Tensor> lm_head,
               c10::optional<torch::Tensor> lm_head_scale)
      : embed_(std::move(embed)), lm_head_(std::move(lm_head)), lm_head_scale_(std::move(lm_head_scale)), eps_(eps), scale_(scale), window_(window),
        num_heads_(num_heads), top_k_(top_k), renormalize_(renormalize) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == torch::kFloat32 && embed_.is_contiguous(),
                "DecodeLayers: the embedding table must be contiguous float32 [vocab, hidden]");
    const size_t n = qkv_w.size();
    TORCH_CHECK(n > 0 && qkv_b.size() == n && q_norm.size() == n && k_norm.size() == n && o_w.size() == n &&
                    post_norm.size() == n && router.size() == n && w13.size() == n && w2.size() == n &&
                    next_norm.size() == n,
                "DecodeLayers: every weight list must have one entry per layer");
    hidden_ = embed_.size(1);
    first_norm_ = vector_of(first_norm, hidden_, "first_norm");
    experts_ = w13[0].size(0);
    TORCH_CHECK(top_k_ >= 1 && top_k_ <= experts_, "DecodeLayers: top_k=", top_k_, " with ", experts_, " experts");
    for (size_t i = 0; i < n; ++i) {
      Layer l;
      l.qkv_w = matrix(qkv_w[i], hidden_, "qkv_w");
      // the workspace is sized from the first layer's shapes: every layer must have them
      TORCH_CHECK(i == 0 || (l.qkv_w.size(0) == qkv_rows_ && input_columns(o_w[i]) == attention_width_),
                  "DecodeLayers: every layer's qkv_w and o_w must have the first layer's shapes");
      qkv_rows_ = l.qkv_w.size(0);
      if (qkv_b[i].has_value() && qkv_b[i]->defined()) l.qkv_b = vector_of(*qkv_b[i], qkv_rows_, "qkv_b");
      TORCH_CHECK(q_norm[i].has_value() == k_norm[i].has_value(), "DecodeLayers: q_norm and k_norm go together");
      l.o_w = matrix(o_w[i], input_columns(o_w[i]), "o_w");
      TORCH_CHECK(l.o_w.size(0) == hidden_, "DecodeLayers: o_w must have hidden rows");
      attention_width_ = input_columns(l.o_w);
      head_dim_ = attention_width_ / num_heads_;
      TORCH_CHECK(head_dim_ * num_heads_ == attention_width_, "DecodeLayers: o_w's columns are not heads x head_dim");
      if (q_norm[i].has_value()) {
        l.q_norm = vector_of(*q_norm[i], head_dim_, "q_norm");
        l.k_norm = vector_of(*k_norm[i], head_dim_, "k_norm");
      }
      l.post_norm = vector_of(post_norm[i], hidden_, "post_norm");
      l.router = matrix(router[i], hidden_, "router");
      TORCH_CHECK(l.router.size(0) == experts_, "DecodeLayers: every router must score the same experts");
      // int8 rows with their scales, int4 rows in blocks (--weights): weight_format.h's stored widths
      const moebench_cpu::WeightFormat* format =
          moebench_cpu::weight_format(w13[i].scalar_type(), moebench_cpu::kExpertWeights);
      const int64_t inter = w13[i].size(1) / 2;
      TORCH_CHECK(format != nullptr && w13[i].dim() == 3 && w2[i].dim() == 3 && w13[i].size(0) == experts_ &&
                      w2[i].size(0) == experts_ && w13[i].size(2) == moebench_cpu::stored_width(*format, hidden_) &&
                      w2[i].size(1) == hidden_ && w2[i].size(2) == moebench_cpu::stored_width(*format, inter) &&
                      w13[i].size(1) == 2 * inter && w13[i].stride(2) == 1 && w2[i].stride(2) == 1 &&
                      w13[i].scalar_type() == w2[i].scalar_type() &&
                      moebench_cpu::takes_rows(w13[i], hidden_, moebench_cpu::kExpertWeights) &&
                      moebench_cpu::takes_rows(w2[i], inter, moebench_cpu::kExpertWeights),
                  "DecodeLayers: w13 must be [E, 2I, hidden] and w2 [E, hidden, I] (+ a format's row bytes), rows "
                  "contiguous, in one of: ", moebench_cpu::accepted_formats(moebench_cpu::kExpertWeights));
      l.w13 = w13[i];
      l.w2 = w2[i];
      l.next_norm = vector_of(next_norm[i], hidden_, "next_norm");
      layers_.push_back(std::move(l));
    }
    // the LM head may be low precision (int8 / fp8 with a row scale, or bfloat16): --lm-head
    if (lm_head_.has_value()) check_lm_head(*lm_head_, lm_head_scale_, hidden_, "DecodeLayers");
    else TORCH_CHECK(!(lm_head_scale_.has_value() && lm_head_scale_->defined()), "DecodeLayers: a row scale without an LM head");
  }

  // From the batch's token ids [B] (int64): their embeddings (the residual stream h) and the first
  // layer's input norm, then every layer. Returns the final norm's output, or with an LM head its
  // logits (float32 [B, vocab]); each layer's top-k expert ids; and each layer's number of distinct
  // experts (what the expert store's look-ups count, MoeBlock.ran_natively).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>> run(
      torch::Tensor input_ids, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, torch::Tensor slots,
      torch::Tensor blocks, torch::Tensor lens, int64_t block_size, std::vector<torch::Tensor> k,
      std::vector<torch::Tensor> v) const {
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(k.size()) == L && static_cast<int64_t>(v.size()) == L,
                "DecodeLayers.run: one K and one V cache per layer");
    PartClock clock(seconds_);
    const auto ids = input_ids.to(torch::kInt64).contiguous();
    const int64_t B = ids.numel(), V = embed_.size(0), D = head_dim_;
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(ip[b] >= 0 && ip[b] < V, "DecodeLayers.run: token id ", ip[b], " outside the vocabulary of ", V);
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
                "DecodeLayers.run: cos and sin must be contiguous float32 [positions, head_dim] tables");
    const int64_t kv_heads = k[0].size(1);
    TORCH_CHECK(k[0].dim() == 3 && k[0].size(2) == D && qkv_rows_ == (num_heads_ + 2 * kv_heads) * D,
                "DecodeLayers.run: the K/V caches' heads do not match the qkv projection");
    for (int64_t i = 0; i < L; ++i)
      TORCH_CHECK(k[i].sizes() == k[0].sizes() && v[i].sizes() == k[0].sizes(),
                  "DecodeLayers.run: every layer's K and V cache must have one shape");
    const DecodeIndex index(positions, slots, blocks, lens, B, block_size, k[0].size(0), cos.size(0));
    Workspace& ws = workspace(B, kv_heads);
    auto topk = torch::empty({L, B, top_k_}, ids.options());
    auto result = torch::empty({B, lm_head_.has_value() ? lm_head_->size(0) : hidden_}, embed_.options());
    std::vector<int64_t> distinct(L);
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
    {
      pybind11::gil_scoped_release no_gil;
      float *h = ws.f(ws.h), *x = ws.f(ws.x);
      for (int64_t b = 0; b < B; ++b)
        std::memcpy(h + b * hidden_, embed_.data_ptr<float>() + ip[b] * hidden_, hidden_ * sizeof(float));
      add_rms_norm_into(h, nullptr, first_norm_.data_ptr<float>(), B, hidden_, eps, x, ws.f(ws.ms));
      clock.lap(kNorms);
      for (int64_t i = 0; i < L; ++i) {
        const Layer& w = layers_[i];
        dense_linear_into(x, hidden_, B, hidden_, w.qkv_w, w.qkv_b.defined() ? w.qkv_b.data_ptr<float>() : nullptr,
                          ws.f(ws.qkv));
        clock.lap(kQkv);
        decode_attention_into(index, ws.f(ws.qkv), qkv_rows_, num_heads_,
                              w.q_norm.defined() ? w.q_norm.data_ptr<float>() : nullptr,
                              w.k_norm.defined() ? w.k_norm.data_ptr<float>() : nullptr, eps, cos.data_ptr<float>(),
                              sin.data_ptr<float>(), k[i], v[i], scale, window_, ws.f(ws.scratch), ws.f(ws.q),
                              ws.f(ws.attention));
        clock.lap(kAttention);
        dense_linear_into(ws.f(ws.attention), attention_width_, B, attention_width_, w.o_w, nullptr,
                          ws.f(ws.projected));
        clock.lap(kOutput);
        add_rms_norm_into(h, ws.f(ws.projected), w.post_norm.data_ptr<float>(), B, hidden_, eps, x, ws.f(ws.ms));
        clock.lap(kNorms);
        int64_t* layer_ids = topk.data_ptr<int64_t>() + i * B * top_k_;
        route(w, x, B, ws, layer_ids);
        clock.lap(kRouter);
        fused_moe_into(x, hidden_, B, ws.f(ws.weights), layer_ids, top_k_, w.w13, w.w2, ws.f(ws.experts));
        clock.lap(kExperts);
        add_rms_norm_into(h, ws.f(ws.experts), w.next_norm.data_ptr<float>(), B, hidden_, eps, x, ws.f(ws.ms));
        clock.lap(kNorms);
        distinct[i] = ws.distinct.mark(layer_ids, B * top_k_);
      }
      if (lm_head_.has_value()) {
        const bool scaled = lm_head_scale_.has_value() && lm_head_scale_->defined();
        dense_linear_into(x, hidden_, B, hidden_, *lm_head_, nullptr, result.data_ptr<float>(),
                          scaled ? lm_head_scale_->data_ptr<float>() : nullptr, /*count=*/false);
        count_lm_head(*lm_head_, scaled);
        clock.lap(kLmHead);
      } else {
        std::memcpy(result.data_ptr<float>(), x, B * hidden_ * sizeof(float));
      }
    }
    std::vector<torch::Tensor> topk_ids;
    topk_ids.reserve(L);
    for (int64_t i = 0; i < L; ++i) topk_ids.push_back(topk[i]);
    return {result, topk_ids, distinct};
  }

  // Seconds spent in each part of run() since construction (benchmarks/decode_breakdown.py).
  std::map<std::string, double> part_seconds() const {
    std::map<std::string, double> out;
    for (int p = 0; p < kParts; ++p) out[kPartNames[p]] = seconds_[p];
    return out;
  }

 private:
  struct Layer {
    torch::Tensor qkv_w, qkv_b, q_norm, k_norm, o_w, post_norm, router, w13, w2, next_norm;
  };

  // A step's activations for one batch size: float32 tensors, each [B, width] (see workspace()).
  struct Workspace {
    std::vector<torch::Tensor> tensors;
    int h, x, qkv, q, attention, projected, logits, probs, weights, experts, ms, scratch;
    moebench_experts::DistinctExperts distinct;
    float* f(int which) { return tensors[which].data_ptr<float>(); }
  };

  Workspace& workspace(int64_t B, int64_t kv_heads) const {
    auto it = workspaces_.find(B);
    if (it != workspaces_.end()) return it->second;
    Workspace ws;
    auto add = [&](int64_t width) {
      ws.tensors.push_back(torch::empty({B, width}, embed_.options()));
      return static_cast<int>(ws.tensors.size() - 1);
    };
    ws.h = add(hidden_), ws.x = add(hidden_), ws.qkv = add(qkv_rows_), ws.q = add(attention_width_);
    ws.attention = add(attention_width_), ws.projected = add(hidden_), ws.logits = add(experts_);
    ws.probs = add(experts_), ws.weights = add(top_k_), ws.experts = add(hidden_), ws.ms = add(1);
    ws.tensors.push_back(torch::empty({decode_attention_scratch(B, num_heads_, kv_heads, head_dim_)}, embed_.options()));
    ws.scratch = static_cast<int>(ws.tensors.size() - 1);
    ws.distinct.resize(experts_);
    return workspaces_.emplace(B, std::move(ws)).first->second;
  }

  // The router chain (route_decode) into the workspace: logits, torch's softmax, route_topk.
  void route(const Layer& w, const float* x, int64_t B, Workspace& ws, int64_t* ids) const {
    dense_linear_into(x, hidden_, B, hidden_, w.router, nullptr, ws.f(ws.logits));
    at::_softmax_out(ws.tensors[ws.probs], ws.tensors[ws.logits], 1, false);
    if (!route_topk_into(ws.f(ws.probs), B, experts_, top_k_, renormalize_, ws.f(ws.weights), ids))
      renormalize_by_torch(ws.tensors[ws.weights]);
  }

  // w as float32 [rows, cols] or bfloat16 with contiguous rows, or int8 rows with their scales
  // [rows, cols + 8] (--weights int8), as dense_linear reads it
  static torch::Tensor matrix(const torch::Tensor& w, int64_t cols, const char* name) {
    TORCH_CHECK(w.dim() == 2 && moebench_cpu::takes_rows(w, cols, moebench_cpu::kDenseWeights),
                "DecodeLayers: ", name, " must be [rows, ", cols, " (+ a format's row bytes)] with contiguous rows in one "
                "of: ", moebench_cpu::accepted_formats(moebench_cpu::kDenseWeights));
    return w;
  }

  // The input width of a weight matrix: its columns, less a row's scale and padding for int8 rows;
  // 32 values per 18-byte block for int4 rows
  static int64_t input_columns(const torch::Tensor& w) {
    const moebench_cpu::WeightFormat* f = moebench_cpu::weight_format(w.scalar_type(), moebench_cpu::kDenseWeights);
    return f != nullptr ? moebench_cpu::input_width(*f, w.size(1)) : w.size(1);
  }

  // w as the float32 contiguous [n] vector the ops convert it to
  static torch::Tensor vector_of(const torch::Tensor& w, int64_t n, const char* name) {
    auto c = w.to(torch::kFloat32).contiguous();
    TORCH_CHECK(c.numel() == n, "DecodeLayers: ", name, " must have ", n, " values");
    return c;
  }

  // A steady clock read is negligible next to the shortest part of a layer (docs/cpu-decode.md).
  enum Part { kQkv, kAttention, kOutput, kNorms, kRouter, kExperts, kLmHead, kParts };
  static constexpr const char* kPartNames[kParts] = {"qkv projection", "attention", "output projection",
                                                      "residual adds and norms", "router", "experts", "LM head"};
  struct PartClock {
    explicit PartClock(double* seconds) : seconds(seconds), last(std::chrono::steady_clock::now()) {}
    void lap(Part part) {
      const auto now = std::chrono::steady_clock::now();
      seconds[part] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
    double* seconds;
    std::chrono::steady_clock::time_point last;
  };

  std::vector<Layer> layers_;
  torch::Tensor embed_, first_norm_;
  c10::optional<torch::Tensor> lm_head_, lm_head_scale_;
  int64_t hidden_ = 0, experts_ = 0, qkv_rows_ = 0, attention_width_ = 0, head_dim_ = 0;
  mutable std::map<int64_t, Workspace> workspaces_;
  mutable double seconds_[kParts] = {};
  double eps_, scale_;
  int64_t window_, num_heads_, top_k_;
  bool renormalize_;
};

}  // namespace

void register_decode_layer(pybind11::module& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers",
                                 "Every layer of a decode step in one call (all layers MoE, experts resident; float32)")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<c10::optional<torch::Tensor>>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>, double,
                          double, int64_t, int64_t, int64_t, bool, torch::Tensor, torch::Tensor,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           "weights of each layer, then eps, scale, window, heads, top_k, renormalize, the embedding table, the "
           "first layer's input norm, the LM head (or None: run returns the final norm's output) and its row "
           "scale (int8 / fp8 heads; else None)",
           pybind11::arg("qkv_w"), pybind11::arg("qkv_b"), pybind11::arg("q_norm"), pybind11::arg("k_norm"),
           pybind11::arg("o_w"), pybind11::arg("post_norm"), pybind11::arg("router"), pybind11::arg("w13"),
           pybind11::arg("w2"), pybind11::arg("next_norm"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("window"), pybind11::arg("num_heads"), pybind11::arg("top_k"), pybind11::arg("renormalize"),
           pybind11::arg("embed"), pybind11::arg("first_norm"), pybind11::arg("lm_head"),
           pybind11::arg("lm_head_scale") = pybind11::none())
      .def("run", &DecodeLayers::run, "A decode step from its token ids: returns (the final norm's output, or the logits with an LM head; each "
           "layer's top-k ids; each layer's number of distinct experts)")
      .def("part_seconds", &DecodeLayers::part_seconds,
           "Seconds run() has spent in each part (qkv projection, attention, ...) since construction");
  m.def("decode_attention_sublayer", &decode_attention_sublayer,
        "qkv projection, decode_attention_block, output projection and add_rms_norm in one call (float32)");
  m.def("route_decode", &route_decode, "Router projection, torch's softmax and route_topk in one call (float32)");
}
