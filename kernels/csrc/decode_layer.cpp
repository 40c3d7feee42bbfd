// Chains of the extension's decode-step ops, each chain one call from Python.
//
// At batch 1 a decode step streams a few hundred MB of weights in ~60 native calls, and the
// interpreter runs between every two of them (argument checks, wrapper functions, torch dispatch)
// with caches the weight stream has just flushed: that time is spent with no weight moving. The
// chains below run the very same kernels in the same order with the same arguments as the calls
// they replace (so their results are bit-identical,
// tests/test_step_ops.py::test_decode_chains_are_the_ops_one_by_one), only without
// returning to Python in between.

#include "cpu_common.h"

#include <ATen/ATen.h>

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

}  // namespace

void register_decode_layer(pybind11::module& m) {
  m.def("decode_attention_sublayer", &decode_attention_sublayer,
        "qkv projection, decode_attention_block, output projection and add_rms_norm in one call (float32)");
  m.def("route_decode", &route_decode, "Router projection, torch's softmax and route_topk in one call (float32)");
}
