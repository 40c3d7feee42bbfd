// The decode step's ops, as each .cpp that defines one (dense_cpu, attention_cpu, norms_cpu,
// routing_cpu, moe_cpu) exports it to Python, and as decode_layer.cpp chains them: the tensor API,
// then the `_into` API that writes into the caller's buffers.
#pragma once

#include "cpu_common.h"

#include <vector>

using moebench_cpu::packed_int8;  // (weight_format.h) the ops below check int8 rows with it

// The ops that decode_layer.cpp chains into one call each (their contracts are written where they are
// defined).
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor decode_attention_block(torch::Tensor qkv, c10::optional<torch::Tensor> q_norm,
                                     c10::optional<torch::Tensor> k_norm, double eps, torch::Tensor cos,
                                     torch::Tensor sin, torch::Tensor positions, torch::Tensor k, torch::Tensor v,
                                     torch::Tensor slots, torch::Tensor blocks, torch::Tensor lens, int64_t block_size,
                                     double scale, int64_t window, int64_t num_heads);
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps);
std::vector<torch::Tensor> route_topk(torch::Tensor probs, int64_t k, bool renormalize);
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids, torch::Tensor w13,
                        torch::Tensor w2);

// ---- the same ops into the caller's buffers ----------------------------------------------
//
// What the ops above compute, written into memory the caller owns, with no tensor made, converted
// or checked and the GIL left as the caller has it (each op above checks its arguments, then calls
// its `_into` core). DecodeLayers runs a whole step on these: inside a step every op starts with
// caches that the weight stream has just flushed, and there one tensor allocation, dtype
// conversion or dispatch costs tens of microseconds (docs/cpu-decode.md).

// out [N, M] (contiguous) = x [N, K] (rows ldx apart) @ w.T (+ bias [M]); w as dense_linear takes it.
// w may also be int8 or float8_e4m3fn (an LM head): then row_scale [M] multiplies each row's sum
// (before the bias); float32 and bfloat16 weights take no scale (null).
// w may also be int8 rows that carry their scale (K + kPackedExtra bytes each, --weights int8): then
// row_scale is null and each row's own scale is read. `count`: add the weights streamed to
// weight_stats as dense weights (the LM head's callers count it in lm_head_stats instead).
void dense_linear_into(const float* x, int64_t ldx, int64_t N, int64_t K, const torch::Tensor& w, const float* bias,
                       float* out, const float* row_scale = nullptr, bool count = true);

// Weights the kernels streamed (weight_stats, the activation evidence of --weights): `which` 0 for
// dense projections (attention, routers, dense MLPs), 1 for routed experts; bytes of rows and scales.
void count_weights(int which, torch::ScalarType dtype, int64_t bytes);

// Counts one LM-head projection that ran in the kernel with weight w (its dtype and the bytes of w
// and its row scale): the activation evidence of a low-precision LM head (lm_head_stats).
void count_lm_head(const torch::Tensor& w, bool scaled);
// Refuses (TORCH_CHECK, naming `who`) an LM head the kernel cannot stream for K input columns, or a
// row scale missing for int8 / fp8, given for float weights, or not contiguous float32 [rows].
void check_lm_head(const torch::Tensor& w, const c10::optional<torch::Tensor>& scale, int64_t K, const char* who);

// h [N, D] += delta (when not null), then out [N, D] = RMSNorm(h) with weight w [D]; ms has N floats.
void add_rms_norm_into(float* h, const float* delta, const float* w, int64_t N, int64_t D, float eps, float* out,
                       float* ms);

// route_topk on probs [N, E] into weights and ids [N, k]. False when renormalizing needs torch's own
// division (no summation order reproduces its sum for this shape): the caller then divides.
bool route_topk_into(const float* probs, int64_t N, int64_t E, int64_t k, bool renormalize, float* weights,
                     int64_t* ids);
// That division, in place: weights [N, k] /= their row sums, by torch's own ops.
void renormalize_by_torch(torch::Tensor& weights);

// decode_attention_block's index tensors, as int64 and contiguous, checked against the RoPE table
// and a pool's size: made once per step, read by every layer's decode_attention_into.
struct DecodeIndex {
  DecodeIndex(const torch::Tensor& positions, const torch::Tensor& slots, const torch::Tensor& blocks,
              const torch::Tensor& lens, int64_t batch, int64_t block_size, int64_t pool_slots, int64_t table_rows);
  torch::Tensor positions, slots, blocks, lens;
  int64_t batch, block_size, pool_slots;
};

// Floats of scratch decode_attention_into needs for B tokens of H query and KVH key heads of D.
inline int64_t decode_attention_scratch(int64_t B, int64_t H, int64_t KVH, int64_t D) { return B * (H + KVH) + D; }

// decode_attention_block into q [B, H, D] (the rotated queries) and out [B, H * D]: qkv [B, ...]
// rows ld apart; q_norm and k_norm [D] float32 or both null; cos and sin rows of D floats; k and v
// the layer's pools (checked: cheap); scratch of decode_attention_scratch floats.
void decode_attention_into(const DecodeIndex& index, const float* qkv, int64_t ld, int64_t H, const float* q_norm,
                           const float* k_norm, float eps, const float* cos, const float* sin, const torch::Tensor& k,
                           const torch::Tensor& v, float scale, int64_t window, float* scratch, float* q, float* out);

// fused_moe into out [N, H] (contiguous): x [N, H] rows ldx apart, topk weights and ids [N, k].
void fused_moe_into(const float* x, int64_t ldx, int64_t N, const float* topk_weights, const int64_t* topk_ids,
                    int64_t k, const torch::Tensor& w13, const torch::Tensor& w2, float* out);
