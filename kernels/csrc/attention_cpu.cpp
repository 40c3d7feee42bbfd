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
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t item = 0; item < B * KVH; ++item) {
    const int64_t b = item / KVH, g = item % KVH;
    const int64_t len = lens[b];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    std::vector<float> m(group, -std::numeric_limits<float>::infinity()), l(group, 0.0f);
    std::vector<float> acc(group * D, 0.0f), s(group);
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
        const float correction = std::exp(m[h] - m_new);  // 0 for the first position (m = -inf)
        const float p = std::exp(s[h] - m_new);
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

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor blocks,
                                     torch::Tensor lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "paged_decode_attention: q must be float32 [B, H, D]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32,
              "paged_decode_attention: k and v must be float32 [slots, kv_heads, D] pools of one shape");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.strides() == v.strides(),
              "paged_decode_attention: k and v rows must be contiguous, with equal strides");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D && H % KVH == 0, "paged_decode_attention: head shapes do not match");
  auto qc = q.contiguous();
  auto bt = blocks.to(torch::kInt64).contiguous();
  auto ln = lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == B && ln.numel() == B, "paged_decode_attention: blocks [B, n], lens [B]");
  const int64_t max_blocks = bt.size(1);
  const int64_t* lp = ln.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * block_size, "paged_decode_attention: context length ", lp[b],
                " of sequence ", b, " does not fit its ", max_blocks, " blocks");
    for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j) {
      const int64_t id = bt.data_ptr<int64_t>()[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && (id + 1) * block_size <= k.size(0), "paged_decode_attention: block id ", id,
                  " outside the pool");
    }
  }
  auto out = torch::empty({B, H, D}, q.options());
  const int threads = std::max(1, at::get_num_threads());
  {
    pybind11::gil_scoped_release no_gil;
    decode_attention_rows(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), bt.data_ptr<int64_t>(), lp,
                          out.data_ptr<float>(), B, H, KVH, D, max_blocks, block_size, k.stride(0), k.stride(1),
                          static_cast<float>(scale), window, threads);
  }
  return out;
}
