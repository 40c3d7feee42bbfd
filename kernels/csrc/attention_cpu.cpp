// CPU decode attention over a paged KV cache: one new token per sequence.
//
// The torch path gathers every sequence's KV blocks into a padded [B, ctx] copy, builds a mask
// and runs SDPA: several passes over the context and a dozen ops per layer. Here each
// (sequence, query head) reads its keys and values straight from the pool through the block
// table, with a two-pass softmax (all scores first, then their max and one vectorised exp over
// them; not flash attention's online softmax), and writes its output row. Work items are
// (sequence, kv head) pairs: the query heads sharing a kv head (GQA) reuse each key and value row
// while it is in L1.
//
// Inputs (float32, last dimension contiguous):
//   q       [B, H, D]                    the new token's queries, RoPE applied
//   k, v    [num_slots, KVH, D]          the layer's pools (slot = block * block_size + offset)
//   blocks  [B, max_blocks] int64        each sequence's block table (padding entries unused)
//   lens    [B] int64                    context length of each sequence, the new token included
//   window  0 or a sliding window        the last `window` positions are attended (Mixtral)
// Output [B, H, D].
//
// `decode_attention_block` does a decode step's whole attention between the qkv projection and
// the output projection in one call: q/k RMSNorm (Qwen3), RoPE, the K/V write into the pool and
// the attention above. Every elementwise step computes what the torch ops it replaces compute,
// rounding for rounding (no fused multiply-add where torch rounds a product first), and the q/k
// RMSNorm is norms_cpu.cpp's, bit-identical to torch's. The attention itself matches SDPA to
// ~1e-6, not bit for bit (its sums run in another order).

#include "ops.h"
#include "norms_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using moebench_cpu::mean_of_squares;
using moebench_cpu::normalize_row;
using moebench_cpu::parallel_for;

// ---- the attention of one (sequence, kv head) item -------------------------------------
//
// A score is dot(q, k) * scale, taken as 8 lanes of fused multiply-adds, scores for 8 positions
// at once (8 independent chains, summed lane-wise after a transpose). Then the softmax in two
// passes over the scores, not online: their max, then every exp(s - max) 8 at a time with a
// polynomial exp (within 2 ulp of std::exp), instead of the online form's position-by-position
// chain of scalar exps, which was the bottleneck (docs/kernels.md), then the weighted sum of value
// rows kept in registers. Each sequence's result depends on its own rows only, never on the batch
// it runs in. It matches the torch reference (SDPA) to ~1e-6, not bit for bit.

// out[j] = lane j of (r + a0[j]... ): the lane-ordered sums of 8 accumulators, as a vector.
inline __m256 lane_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  // 8x8 transpose: t[l] holds lane l of every accumulator
  const __m256 u0 = _mm256_unpacklo_ps(a0, a1), u1 = _mm256_unpackhi_ps(a0, a1);
  const __m256 u2 = _mm256_unpacklo_ps(a2, a3), u3 = _mm256_unpackhi_ps(a2, a3);
  const __m256 u4 = _mm256_unpacklo_ps(a4, a5), u5 = _mm256_unpackhi_ps(a4, a5);
  const __m256 u6 = _mm256_unpacklo_ps(a6, a7), u7 = _mm256_unpackhi_ps(a6, a7);
  const __m256 v0 = _mm256_shuffle_ps(u0, u2, 0x44), v1 = _mm256_shuffle_ps(u0, u2, 0xEE);
  const __m256 v2 = _mm256_shuffle_ps(u1, u3, 0x44), v3 = _mm256_shuffle_ps(u1, u3, 0xEE);
  const __m256 v4 = _mm256_shuffle_ps(u4, u6, 0x44), v5 = _mm256_shuffle_ps(u4, u6, 0xEE);
  const __m256 v6 = _mm256_shuffle_ps(u5, u7, 0x44), v7 = _mm256_shuffle_ps(u5, u7, 0xEE);
  const __m256 t0 = _mm256_permute2f128_ps(v0, v4, 0x20), t4 = _mm256_permute2f128_ps(v0, v4, 0x31);
  const __m256 t1 = _mm256_permute2f128_ps(v1, v5, 0x20), t5 = _mm256_permute2f128_ps(v1, v5, 0x31);
  const __m256 t2 = _mm256_permute2f128_ps(v2, v6, 0x20), t6 = _mm256_permute2f128_ps(v2, v6, 0x31);
  const __m256 t3 = _mm256_permute2f128_ps(v3, v7, 0x20), t7 = _mm256_permute2f128_ps(v3, v7, 0x31);
  __m256 r = _mm256_add_ps(_mm256_setzero_ps(), t0);
  r = _mm256_add_ps(r, t1);
  r = _mm256_add_ps(r, t2);
  r = _mm256_add_ps(r, t3);
  r = _mm256_add_ps(r, t4);
  r = _mm256_add_ps(r, t5);
  r = _mm256_add_ps(r, t6);
  return _mm256_add_ps(r, t7);
}

// Scores of one query head against up to 8 key rows (missing rows repeat the last): s[j].
inline void scores8(const float* qh, const float* const* kr, int64_t rows, int64_t D, float scale, float* s) {
  const float* k[8];
  for (int j = 0; j < 8; ++j) k[j] = kr[j < rows ? j : rows - 1];
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(qh + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + d), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + d), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + d), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + d), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + d), a7);
  }
  if (d < D) {  // the rest of the elements go into lane 0 of each accumulator, in order
    alignas(32) float lane0[8];
    lane0[0] = _mm256_cvtss_f32(a0), lane0[1] = _mm256_cvtss_f32(a1), lane0[2] = _mm256_cvtss_f32(a2);
    lane0[3] = _mm256_cvtss_f32(a3), lane0[4] = _mm256_cvtss_f32(a4), lane0[5] = _mm256_cvtss_f32(a5);
    lane0[6] = _mm256_cvtss_f32(a6), lane0[7] = _mm256_cvtss_f32(a7);
    for (; d < D; ++d)
      for (int j = 0; j < 8; ++j) lane0[j] = std::fma(qh[d], k[j][d], lane0[j]);
    const __m256 keep = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, -1, -1, -1, -1, -1, -1));
    a0 = _mm256_blendv_ps(_mm256_set1_ps(lane0[0]), a0, keep);
    a1 = _mm256_blendv_ps(_mm256_set1_ps(lane0[1]), a1, keep);
    a2 = _mm256_blendv_ps(_mm256_set1_ps(lane0[2]), a2, keep);
    a3 = _mm256_blendv_ps(_mm256_set1_ps(lane0[3]), a3, keep);
    a4 = _mm256_blendv_ps(_mm256_set1_ps(lane0[4]), a4, keep);
    a5 = _mm256_blendv_ps(_mm256_set1_ps(lane0[5]), a5, keep);
    a6 = _mm256_blendv_ps(_mm256_set1_ps(lane0[6]), a6, keep);
    a7 = _mm256_blendv_ps(_mm256_set1_ps(lane0[7]), a7, keep);
  }
  const __m256 r = _mm256_mul_ps(lane_sums8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale));
  alignas(32) float out[8];
  _mm256_store_ps(out, r);
  for (int64_t j = 0; j < rows; ++j) s[j] = out[j];
}

// exp of 8 floats, all <= 0 here (scores minus their max): 2^n * e^r with n = round(x / ln 2) and
// r = x - n ln 2 (ln 2 split in two parts so r is exact to float precision), e^r by its degree-6
// Taylor-like minimax polynomial on |r| <= ln2 / 2; within 2 ulp of std::exp. Below -87 the
// result is flushed to 0 (the largest score's term is exactly 1, so such terms cannot matter).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Softmax weights of n scores, in place: p[i] = exp(s[i] - max s); returns their sum.
inline float softmax_weights(float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (int64_t t = i; t < n; ++t) m = std::max(m, s[t]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mb));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) {  // the tail through a padded vector (-inf scores weigh 0)
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? s[i + j] : -std::numeric_limits<float>::infinity();
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(tail), mb));
    _mm256_store_ps(tail, e);
    for (int64_t j = 0; i + j < n; ++j) s[i + j] = tail[j];
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_store_ps(lanes, sum);
  float l = 0.0f;
  for (int j = 0; j < 8; ++j) l += lanes[j];
  return l;
}

// out[0:D] = sum_i p[i] * v_i / l: up to 8 vectors of the row stay in registers over all positions.
inline void weighted_rows(const float* const* vrows, const float* p, int64_t n, int64_t D, float l, float* out) {
  const float inv = 1.0f / l;
  int64_t d0 = 0;
  for (; d0 + 8 <= D; d0 += 64) {
    const int64_t nv = std::min<int64_t>(8, (D - d0) / 8);
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 pv = _mm256_set1_ps(p[i]);
      const float* vr = vrows[i] + d0;
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c)
        if (c < nv) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * c), a[c]);
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (int c = 0; c < nv; ++c) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_mul_ps(a[c], iv));
    if (nv < 8) {
      d0 += 8 * nv;
      break;
    }
  }
  for (int64_t d = d0; d < D; ++d) {  // the last D % 8 elements
    float a = 0.0f;
    for (int64_t i = 0; i < n; ++i) a = std::fma(p[i], vrows[i][d], a);
    out[d] = a * inv;
  }
}

void decode_attention_rows(const float* q, const float* k, const float* v, const int64_t* blocks, const int64_t* lens,
                           float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                           int64_t block_size, int64_t slot_stride, int64_t head_stride, float scale, int64_t window,
                           int threads) {
  const int64_t group = H / KVH;
  parallel_for(B * KVH, threads, [&](int64_t item) {
    // per thread, reused by every item it runs: key and value rows, each head's scores (then weights)
    thread_local std::vector<float> s;
    thread_local std::vector<const float*> krows, vrows;
    const int64_t b = item / KVH, g = item % KVH;
    const int64_t len = lens[b];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t n = len - first;
    if (static_cast<int64_t>(krows.size()) < n || static_cast<int64_t>(s.size()) < group * n) {
      s.resize(std::max<int64_t>(s.size(), group * n));
      krows.resize(std::max<int64_t>(krows.size(), n));
      vrows.resize(std::max<int64_t>(vrows.size(), n));
    }
    for (int64_t t = first; t < len; ++t) {
      const int64_t slot = blocks[b * max_blocks + t / block_size] * block_size + t % block_size;
      krows[t - first] = k + slot * slot_stride + g * head_stride;
      vrows[t - first] = v + slot * slot_stride + g * head_stride;
    }
    const float* qb = q + (b * H + g * group) * D;
    for (int64_t h = 0; h < group; ++h) {
      float* sh = s.data() + h * n;
      for (int64_t i = 0; i < n; i += 8)
        scores8(qb + h * D, krows.data() + i, std::min<int64_t>(8, n - i), D, scale, sh + i);
      const float l = softmax_weights(sh, n);
      weighted_rows(vrows.data(), sh, n, D, l, out + (b * H + g * group + h) * D);
    }
  });
}

void check_pools(const torch::Tensor& k, const torch::Tensor& v, int64_t D, int64_t H) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32,
              "paged_decode_attention: k and v must be float32 [slots, kv_heads, D] pools of one shape");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.strides() == v.strides(),
              "paged_decode_attention: k and v rows must be contiguous, with equal strides");
  TORCH_CHECK(k.size(2) == D && H % k.size(1) == 0, "paged_decode_attention: head shapes do not match");
}

// Every context position of every sequence must lie in a block of the pool.
void check_blocks(const torch::Tensor& bt, const torch::Tensor& ln, int64_t B, int64_t block_size, int64_t slots) {
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == B && ln.numel() == B, "paged_decode_attention: blocks [B, n], lens [B]");
  const int64_t max_blocks = bt.size(1);
  const int64_t* lp = ln.data_ptr<int64_t>();
  const int64_t* bp = bt.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * block_size, "paged_decode_attention: context length ", lp[b],
                " of sequence ", b, " does not fit its ", max_blocks, " blocks");
    for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j) {
      const int64_t id = bp[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && (id + 1) * block_size <= slots, "paged_decode_attention: block id ", id,
                  " outside the pool");
    }
  }
}

void run_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& bt,
                   const torch::Tensor& ln, torch::Tensor& out, int64_t block_size, double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int threads = moebench_cpu::step_threads();
  pybind11::gil_scoped_release no_gil;
  decode_attention_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), bt.data_ptr<int64_t>(),
                        ln.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, bt.size(1), block_size,
                        k.stride(0), k.stride(1), static_cast<float>(scale), window, threads);
}

// RoPE must round exactly as torch's ops do: no contraction of a product and a sum into one fused
// multiply-add. Not inlined, so that the setting holds for it wherever it is called from (and the
// attention loop above keeps its own).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// RoPE, rotate-half: out = x * cos + cat(-x2, x1) * sin, each product rounded, then the sum.
__attribute__((noinline)) void rope_row(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d] * c[d];
    const float b = -x[d + half] * s[d];
    out[d] = a + b;
  }
  for (int64_t d = half; d < D; ++d) {
    const float a = x[d] * c[d];
    const float b = x[d - half] * s[d];
    out[d] = a + b;
  }
}

#pragma GCC pop_options

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor blocks,
                                     torch::Tensor lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "paged_decode_attention: q must be float32 [B, H, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_pools(k, v, D, H);
  auto qc = q.contiguous();
  auto bt = blocks.to(torch::kInt64).contiguous();
  auto ln = lens.to(torch::kInt64).contiguous();
  check_blocks(bt, ln, B, block_size, k.size(0));
  auto out = torch::empty({B, H, D}, q.options());
  run_attention(qc, k, v, bt, ln, out, block_size, scale, window);
  return out;
}

// A decode step's attention from the qkv projection to the input of the output projection.
//   qkv      [B, (H + 2 KVH) * D] float32: q heads, then k heads, then v heads of each token
//   q_norm, k_norm  [D] RMSNorm weights (Qwen3) or None (no q/k norm)
//   cos, sin [P, D] RoPE tables, positions [B] int64 rows of them
//   k, v     the layer's pools, slots [B] int64 where each token's K/V goes
// Returns [B, H * D]: the attention output of every head, in head order.
torch::Tensor decode_attention_block(torch::Tensor qkv, c10::optional<torch::Tensor> q_norm,
                                     c10::optional<torch::Tensor> k_norm, double eps, torch::Tensor cos,
                                     torch::Tensor sin, torch::Tensor positions, torch::Tensor k, torch::Tensor v,
                                     torch::Tensor slots, torch::Tensor blocks, torch::Tensor lens, int64_t block_size,
                                     double scale, int64_t window, int64_t num_heads) {
  const int64_t B = qkv.size(0), H = num_heads, KVH = k.size(1), D = k.size(2);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (H + 2 * KVH) * D,
              "decode_attention_block: qkv must be float32 [B, (H + 2 KVH) * D] with contiguous rows");
  check_pools(k, v, D, H);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_attention_block: q_norm and k_norm go together");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "decode_attention_block: cos and sin must be contiguous float32 [positions, D] tables");
  const DecodeIndex index(positions, slots, blocks, lens, B, block_size, k.size(0), cos.size(0));
  torch::Tensor qwc, kwc;
  if (q_norm.has_value()) {
    qwc = q_norm->to(torch::kFloat32).contiguous();
    kwc = k_norm->to(torch::kFloat32).contiguous();
    TORCH_CHECK(qwc.numel() == D && kwc.numel() == D, "decode_attention_block: q_norm and k_norm must be [D]");
  }
  auto qr = torch::empty({B, H, D}, qkv.options());
  auto out = torch::empty({B, H, D}, qkv.options());
  std::vector<float> scratch(static_cast<size_t>(decode_attention_scratch(B, H, KVH, D)));
  pybind11::gil_scoped_release no_gil;
  decode_attention_into(index, qkv.data_ptr<float>(), qkv.stride(0), H, qwc.defined() ? qwc.data_ptr<float>() : nullptr,
                        kwc.defined() ? kwc.data_ptr<float>() : nullptr, static_cast<float>(eps), cos.data_ptr<float>(),
                        sin.data_ptr<float>(), k, v, static_cast<float>(scale), window, scratch.data(),
                        qr.data_ptr<float>(), out.data_ptr<float>());
  return out.view({B, H * D});
}

DecodeIndex::DecodeIndex(const torch::Tensor& positions_, const torch::Tensor& slots_, const torch::Tensor& blocks_,
                         const torch::Tensor& lens_, int64_t batch_, int64_t block_size_, int64_t pool_slots,
                         int64_t table_rows)
    : positions(positions_.to(torch::kInt64).contiguous()),
      slots(slots_.to(torch::kInt64).contiguous()),
      blocks(blocks_.to(torch::kInt64).contiguous()),
      lens(lens_.to(torch::kInt64).contiguous()),
      batch(batch_),
      block_size(block_size_),
      pool_slots(pool_slots) {
  TORCH_CHECK(positions.numel() == batch && slots.numel() == batch,
              "decode_attention_block: positions and slots must be [B]");
  check_blocks(blocks, lens, batch, block_size, pool_slots);
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(pp[b] >= 0 && pp[b] < table_rows, "decode_attention_block: position ", pp[b], " outside the table");
    TORCH_CHECK(sp[b] >= 0 && sp[b] < pool_slots, "decode_attention_block: slot ", sp[b], " outside the pool");
  }
}

void decode_attention_into(const DecodeIndex& index, const float* x, int64_t ld, int64_t H, const float* qw,
                           const float* kw, float eps, const float* cos, const float* sin, const torch::Tensor& k,
                           const torch::Tensor& v, float scale, int64_t window, float* scratch, float* qo,
                           float* out) {
  const int64_t B = index.batch, KVH = k.size(1), D = k.size(2);
  check_pools(k, v, D, H);
  TORCH_CHECK(k.size(0) >= index.pool_slots, "decode_attention_block: the pool has fewer slots than the index was checked for");
  const int64_t* pp = index.positions.data_ptr<int64_t>();
  const int64_t* sp = index.slots.data_ptr<int64_t>();
  const int64_t QK = H + KVH;  // heads that get RMSNorm and RoPE
  float* ms = qw != nullptr ? scratch : nullptr;  // rows of D values: head j of token b starts at b * ld + j * D
  float* normed = scratch + B * QK;
  if (ms != nullptr)
    for (int64_t b = 0; b < B; ++b) mean_of_squares(x + b * ld, QK, D, D, ms + b * QK);
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = x + b * ld;
    const float* c = cos + pp[b] * D;
    const float* s = sin + pp[b] * D;
    for (int64_t j = 0; j < QK; ++j) {
      const float* head = row + j * D;
      if (ms != nullptr) {
        normalize_row(head, ms[b * QK + j], eps, j < H ? qw : kw, normed, D);
        head = normed;
      }
      float* dst = j < H ? qo + (b * H + j) * D : kp + sp[b] * ks0 + (j - H) * ks1;
      rope_row(head, c, s, dst, D);
    }
    for (int64_t j = 0; j < KVH; ++j) {
      const float* src = row + (QK + j) * D;
      std::copy(src, src + D, vp + sp[b] * ks0 + j * ks1);
    }
  }
  decode_attention_rows(qo, kp, vp, index.blocks.data_ptr<int64_t>(), index.lens.data_ptr<int64_t>(), out, B, H, KVH,
                        D, index.blocks.size(1), index.block_size, ks0, ks1, scale, window,
                        moebench_cpu::step_threads());
}

void register_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention (one query per sequence) over a paged float32 KV cache");
  m.def("decode_attention_block", &decode_attention_block,
        "A decode step's attention: q/k RMSNorm, RoPE, K/V write, paged attention (float32)");
}
