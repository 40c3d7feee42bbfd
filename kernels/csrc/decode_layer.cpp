// Chains of the extension's decode-step ops, each chain one call from Python.
//
// At batch 1 a decode step streams a few hundred MB of weights in ~60 native calls, and the
// interpreter runs between every two of them (argument checks, wrapper functions, torch dispatch,
// the MoE block's store, prefetcher and statistics hooks) with caches the weight stream has just
// flushed: that time is spent with no weight moving. The chains below run the very same kernels in
// the same order with the same arguments as the calls they replace (so their results are
// bit-identical, tests/test_step_ops.py::test_decode_chains_are_the_ops_one_by_one), only without
// returning to Python in between. The longest, DecodeLayers, is all of a step's layers.

#include "cpu_common.h"

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
// The weights are taken once, at construction; a step passes what changes: the residual stream,
// the batch's index tensors, the RoPE tables (they grow) and the K/V caches.
class DecodeLayers {
 public:
  DecodeLayers(std::vector<torch::Tensor> qkv_w, std::vector<c10::optional<torch::Tensor>> qkv_b,
               std::vector<c10::optional<torch::Tensor>> q_norm, std::vector<c10::optional<torch::Tensor>> k_norm,
               std::vector<torch::Tensor> o_w, std::vector<torch::Tensor> post_norm, std::vector<torch::Tensor> router,
               std::vector<torch::Tensor> w13, std::vector<torch::Tensor> w2, std::vector<torch::Tensor> next_norm,
               double eps, double scale, int64_t window, int64_t num_heads, int64_t top_k, bool renormalize,
               torch::Tensor embed, torch::Tensor first_norm, c10::optional<torch::Tensor> lm_head)
      : embed_(std::move(embed)), first_norm_(std::move(first_norm)), lm_head_(std::move(lm_head)), eps_(eps),
        scale_(scale), window_(window), num_heads_(num_heads), top_k_(top_k), renormalize_(renormalize) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == torch::kFloat32 && embed_.is_contiguous(),
                "DecodeLayers: the embedding table must be contiguous float32 [vocab, hidden]");
    const size_t n = qkv_w.size();
    TORCH_CHECK(qkv_b.size() == n && q_norm.size() == n && k_norm.size() == n && o_w.size() == n &&
                    post_norm.size() == n && router.size() == n && w13.size() == n && w2.size() == n &&
                    next_norm.size() == n,
                "DecodeLayers: every weight list must have one entry per layer");
    for (size_t i = 0; i < n; ++i)
      layers_.push_back({qkv_w[i], qkv_b[i], q_norm[i], k_norm[i], o_w[i], post_norm[i], router[i], w13[i], w2[i],
                         next_norm[i]});
  }

  // From the batch's token ids [B] (int64): their embeddings (the residual stream h) and the first
  // layer's input norm, then every layer. Returns the final norm's output, or with an LM head its
  // logits (float32 [B, vocab]); each layer's top-k expert ids; and each layer's number of distinct
  // experts (what the expert store's look-ups count, MoeBlock.ran_natively).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>> run(
      torch::Tensor input_ids, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, torch::Tensor slots,
      torch::Tensor blocks, torch::Tensor lens, int64_t block_size, std::vector<torch::Tensor> k,
      std::vector<torch::Tensor> v) const {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(),
                "DecodeLayers.run: one K and one V cache per layer");
    PartClock clock(seconds_);
    auto h = embeddings(input_ids);
    auto x = add_rms_norm(h, c10::nullopt, first_norm_, eps_);
    clock.lap(kNorms);
    std::vector<torch::Tensor> topk_ids;
    std::vector<int64_t> distinct;
    topk_ids.reserve(layers_.size());
    distinct.reserve(layers_.size());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& w = layers_[i];
      // decode_attention_sublayer's ops, each timed
      auto qkv = dense_linear(x, w.qkv_w, w.qkv_b);
      clock.lap(kQkv);
      auto attention = decode_attention_block(qkv, w.q_norm, w.k_norm, eps_, cos, sin, positions, k[i], v[i], slots,
                                              blocks, lens, block_size, scale_, window_, num_heads_);
      clock.lap(kAttention);
      auto projected = dense_linear(attention, w.o_w, c10::nullopt);
      clock.lap(kOutput);
      x = add_rms_norm(h, projected, w.post_norm, eps_);
      clock.lap(kNorms);
      auto routed = route_decode(x, w.router, top_k_, renormalize_);
      clock.lap(kRouter);
      auto experts = fused_moe(x, routed[0], routed[1], w.w13, w.w2);
      clock.lap(kExperts);
      x = add_rms_norm(h, experts, w.next_norm, eps_);
      clock.lap(kNorms);
      distinct.push_back(distinct_experts(routed[1], w.w13.size(0)));
      topk_ids.push_back(routed[1]);
    }
    if (lm_head_.has_value()) {
      x = dense_linear(x, *lm_head_, c10::nullopt);
      clock.lap(kLmHead);
    }
    return {x, topk_ids, distinct};
  }

  // Seconds spent in each part of run() since construction (benchmarks/decode_breakdown.py).
  std::map<std::string, double> part_seconds() const {
    std::map<std::string, double> out;
    for (int p = 0; p < kParts; ++p) out[kPartNames[p]] = seconds_[p];
    return out;
  }

 private:
  // embed_'s rows of the token ids, as embed[input_ids] gives them
  torch::Tensor embeddings(const torch::Tensor& input_ids) const {
    auto ids = input_ids.to(torch::kInt64).contiguous();
    const int64_t B = ids.numel(), D = embed_.size(1), V = embed_.size(0);
    auto h = torch::empty({B, D}, embed_.options());
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ip[b] >= 0 && ip[b] < V, "DecodeLayers.run: token id ", ip[b], " outside the vocabulary of ", V);
      std::memcpy(h.data_ptr<float>() + b * D, embed_.data_ptr<float>() + ip[b] * D, D * sizeof(float));
    }
    return h;
  }

  static int64_t distinct_experts(const torch::Tensor& ids, int64_t experts) {
    std::vector<bool> seen(experts);
    int64_t count = 0;
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i)
      if (!seen[p[i]]) {
        seen[p[i]] = true;
        ++count;
      }
    return count;
  }

  struct Layer {
    torch::Tensor qkv_w;
    c10::optional<torch::Tensor> qkv_b, q_norm, k_norm;
    torch::Tensor o_w, post_norm, router, w13, w2, next_norm;
  };
  // A steady clock read costs ~20 ns, against ~100 us for the shortest part of a layer.
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
  c10::optional<torch::Tensor> lm_head_;
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
                          c10::optional<torch::Tensor>>(),
           "weights of each layer, then eps, scale, window, heads, top_k, renormalize, the embedding table, the "
           "first layer's input norm and the LM head (or None: run returns the final norm's output)")
      .def("run", &DecodeLayers::run, "A decode step from its token ids: returns (the final norm's output, or the logits with an LM head; each "
           "layer's top-k ids; each layer's number of distinct experts)")
      .def("part_seconds", &DecodeLayers::part_seconds,
           "Seconds run() has spent in each part (qkv projection, attention, ...) since construction");
  m.def("decode_attention_sublayer", &decode_attention_sublayer,
        "qkv projection, decode_attention_block, output projection and add_rms_norm in one call (float32)");
  m.def("route_decode", &route_decode, "Router projection, torch's softmax and route_topk in one call (float32)");
}
