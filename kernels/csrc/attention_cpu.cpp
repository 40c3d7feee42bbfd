// CPU decode attention over a paged KV cache: one new token per sequence.
//
// The torch path gathers every sequence's KV blocks into a padded [B, ctx] copy, builds a mask
// and runs SDPA: several passes over the context and a dozen ops per layer. Here each
// (sequence, query head) reads its keys and values straight from the pool through the block
// table, once, with an online softmax (running max and sum, as flash attention does), and writes
// its output row. Work items are (sequence, kv head) pairs: the query heads sharing a kv head
// (GQA) reuse each key and value row while it is in L1.
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
// rounding for rounding (no fused multiply-add where torch rounds a product first); the one
// reduction (the mean of squares of RMSNorm) is torch's own `mean`. `add_rms_norm` is the
// residual add plus RMSNorm the same way. Results are bit-identical to the torch path's.

#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

void decode_attention_rows(const float* q, const float* k, const float* v, const int64_t* blocks, const int64_t* lens,
                           float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                           int64_t block_size, int64_t slot_stride, int64_t head_stride, float scale, int64_t window,
                           int threads) {
  const int64_t group = H / KVH;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // per-thread running max, sum, accumulators and scores, reused by every work item
    std::vector<float> m(group), l(group), acc(group * D), s(group);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * KVH; ++item) {
      const int64_t b = item / KVH, g = item % KVH;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const float* qb = q + (b * H + g * group) * D;
      for (int64_t t = first; t < len; ++t) {
        const int64_t slot = blocks[b * max_blocks + t / block_size] * block_size + t % block_size;
        const float* kr = k + slot * slot_stride + g * head_stride;
        const float* vr = v + slot * slot_stride + g * head_stride;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qb + h * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * kr[d];
          s[h] = dot * scale;
        }
        for (int64_t h = 0; h < group; ++h) {
          const float m_new = std::max(m[h], s[h]);
          // One of the two exponents is exp(0) = 1 (the new score is the running max, or it is
          // not and the max stays): skipping that call gives the very same values.
          const float dm = m[h] - m_new;  // -inf for the first position (m = -inf): correction 0
          const float ds = s[h] - m_new;
          const float correction = dm == 0.0f ? 1.0f : std::exp(dm);
          const float p = ds == 0.0f ? 1.0f : std::exp(ds);
          l[h] = l[h] * correction + p;
          m[h] = m_new;
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] = a[d] * correction + p * vr[d];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* o = out + (b * H + g * group + h) * D;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
      }
    }
  }
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
  const int threads = std::max(1, at::get_num_threads());
  pybind11::gil_scoped_release no_gil;
  decode_attention_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), bt.data_ptr<int64_t>(),
                        ln.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, bt.size(1), block_size,
                        k.stride(0), k.stride(1), static_cast<float>(scale), window, threads);
}

// Mean of squares of each row of x [R, D] (rows at stride ld): torch's own `mean`, so the sum is
// taken in torch's order; the squares are exact products either way.
torch::Tensor mean_of_squares(const float* x, int64_t R, int64_t D, int64_t ld) {
  auto sq = torch::empty({R, D}, torch::kFloat32);
  float* s = sq.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * ld;
    float* sr = s + r * D;
    for (int64_t d = 0; d < D; ++d) sr[d] = xr[d] * xr[d];
  }
  return at::mean(sq, {-1}).contiguous();
}

// The elementwise steps below must round exactly as torch's ops do: no contraction of a product
// and a sum into one fused multiply-add. Not inlined, so that the setting holds for them wherever
// they are called from (and the attention loop above keeps its own).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// out = (x * (1 / sqrt(ms + eps))) * w: F.rms_norm's float32 steps (add eps, rsqrt, two products).
__attribute__((noinline)) void normalize_row(const float* x, float ms, float eps, const float* w, float* out, int64_t D) {
  const float r = 1.0f / std::sqrt(ms + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = (x[d] * r) * w[d];
}

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

__attribute__((noinline)) void add_rows(float* h, const float* delta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = h[i] + delta[i];
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
  auto pos = positions.to(torch::kInt64).contiguous();
  auto sl = slots.to(torch::kInt64).contiguous();
  auto bt = blocks.to(torch::kInt64).contiguous();
  auto ln = lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(pos.numel() == B && sl.numel() == B, "decode_attention_block: positions and slots must be [B]");
  check_blocks(bt, ln, B, block_size, k.size(0));
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pp[b] >= 0 && pp[b] < cos.size(0), "decode_attention_block: position ", pp[b], " outside the table");
    TORCH_CHECK(sp[b] >= 0 && sp[b] < k.size(0), "decode_attention_block: slot ", sp[b], " outside the pool");
  }

  const float* x = qkv.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  const int64_t QK = H + KVH;  // heads that get RMSNorm and RoPE
  torch::Tensor ms;
  const float *qw = nullptr, *kw = nullptr;
  torch::Tensor qwc, kwc;
  if (q_norm.has_value()) {
    qwc = q_norm->to(torch::kFloat32).contiguous();
    kwc = k_norm->to(torch::kFloat32).contiguous();
    TORCH_CHECK(qwc.numel() == D && kwc.numel() == D, "decode_attention_block: q_norm and k_norm must be [D]");
    qw = qwc.data_ptr<float>();
    kw = kwc.data_ptr<float>();
    // rows of D values: head j of token b starts at b * ld + j * D
    auto sq = torch::empty({B * QK, D}, torch::kFloat32);
    float* s = sq.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < QK * D; ++j) s[b * QK * D + j] = x[b * ld + j] * x[b * ld + j];
    ms = at::mean(sq, {-1}).contiguous();
  }
  const float* msp = ms.defined() ? ms.data_ptr<float>() : nullptr;
  const float epsf = static_cast<float>(eps);
  auto qr = torch::empty({B, H, D}, qkv.options());
  float* qo = qr.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1);
  std::vector<float> normed(D);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = x + b * ld;
    const float* c = cos.data_ptr<float>() + pp[b] * D;
    const float* s = sin.data_ptr<float>() + pp[b] * D;
    for (int64_t j = 0; j < QK; ++j) {
      const float* head = row + j * D;
      if (msp != nullptr) {
        normalize_row(head, msp[b * QK + j], epsf, j < H ? qw : kw, normed.data(), D);
        head = normed.data();
      }
      float* dst = j < H ? qo + (b * H + j) * D : kp + sp[b] * ks0 + (j - H) * ks1;
      rope_row(head, c, s, dst, D);
    }
    for (int64_t j = 0; j < KVH; ++j) {
      const float* src = row + (QK + j) * D;
      std::copy(src, src + D, vp + sp[b] * ks0 + j * ks1);
    }
  }
  auto out = torch::empty({B, H, D}, qkv.options());
  run_attention(qr, k, v, bt, ln, out, block_size, scale, window);
  return out.view({B, H * D});
}

// h += delta (when given), then RMSNorm of h with weight w: h + delta and F.rms_norm as torch
// computes them. h [N, D] float32 contiguous is updated in place; returns the normalized [N, D].
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat32 && h.is_contiguous(),
              "add_rms_norm: h must be a contiguous float32 [N, D] tensor");
  const int64_t N = h.size(0), D = h.size(1);
  auto wc = w.to(torch::kFloat32).contiguous();
  TORCH_CHECK(wc.numel() == D, "add_rms_norm: weight must be [D]");
  float* hp = h.data_ptr<float>();
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == torch::kFloat32,
                "add_rms_norm: delta must be float32 of h's shape");
    auto dc = delta->contiguous();
    add_rows(hp, dc.data_ptr<float>(), N * D);
  }
  auto ms = mean_of_squares(hp, N, D, D);
  auto out = torch::empty({N, D}, h.options());
  const float* msp = ms.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  for (int64_t n = 0; n < N; ++n) normalize_row(hp + n * D, msp[n], epsf, wp, op + n * D, D);
  return out;
}

// Softmax router's top-k on probabilities [N, E] float32: the k largest per row, descending,
// equal values ordered by the lower expert index (a stable descending sort's first k), NaN
// above every number as torch sorts it. With `renormalize`, each weight is divided by the sum
// of the row's k weights, which for k <= 2 is a single rounded addition (any order gives it).
std::vector<torch::Tensor> route_topk(torch::Tensor probs, int64_t k, bool renormalize) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32, "route_topk: probs must be float32 [N, E]");
  const int64_t N = probs.size(0), E = probs.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "route_topk: top_k=", k, " with ", E, " experts");
  TORCH_CHECK(!renormalize || k <= 2, "route_topk: renormalizing more than 2 weights is left to torch");
  auto p = probs.contiguous();
  auto weights = torch::empty({N, k}, p.options());
  auto ids = torch::empty({N, k}, p.options().dtype(torch::kInt64));
  const float* pp = p.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  // a before b in a stable descending sort (NaN counts as the largest value)
  auto before = [](float a, int64_t ia, float b, int64_t ib) {
    const bool na = std::isnan(a), nb = std::isnan(b);
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
  };
  for (int64_t n = 0; n < N; ++n) {
    const float* row = pp + n * E;
    float* w = wp + n * k;
    int64_t* id = ip + n * k;
    int64_t filled = 0;
    for (int64_t e = 0; e < E; ++e) {  // insertion into the sorted top-k so far
      if (filled == k && !before(row[e], e, w[k - 1], id[k - 1])) continue;
      int64_t j = filled < k ? filled++ : k - 1;
      while (j > 0 && before(row[e], e, w[j - 1], id[j - 1])) {
        w[j] = w[j - 1];
        id[j] = id[j - 1];
        --j;
      }
      w[j] = row[e];
      id[j] = e;
    }
    if (renormalize) {
      const float sum = k == 1 ? w[0] : w[0] + w[1];
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / sum;
    }
  }
  return {weights, ids};
}

void register_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention (one query per sequence) over a paged float32 KV cache");
  m.def("decode_attention_block", &decode_attention_block,
        "A decode step's attention: q/k RMSNorm, RoPE, K/V write, paged attention (float32)");
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then RMSNorm of h (float32)");
  m.def("route_topk", &route_topk, "Top-k of router probabilities, ties to the lower index (float32)");
}
