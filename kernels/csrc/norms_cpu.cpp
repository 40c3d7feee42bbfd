// RMSNorm on the CPU as torch computes it, and the sums in torch's order it shares with the router.
//
// `add_rms_norm` is the residual add plus RMSNorm of the decode step: every elementwise step
// computes what the torch ops it replaces compute, rounding for rounding (no fused multiply-add
// where torch rounds a product first), and the one reduction, the mean of squares, adds in torch's
// order, checked against torch's own mean for each row length before it is used. So it is
// bit-identical to the torch path's `h + delta` and F.rms_norm. decode_attention_block's q/k
// RMSNorm (attention_cpu.cpp) and the router's renormalization and means (routing_cpu.cpp) use the
// same pieces (norms_cpu.h).

#include "ops.h"
#include "norms_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace {

using moebench_cpu::SumFn;

// ---- sums in torch's order ----------------------------------------------------------------
//
// torch's CPU sum of a contiguous row (SumKernel.cpp) adds in a fixed order: the row is read as
// vectors of V floats; vector i goes to chain i % 4 (four independent accumulators, each a
// cascade of partial sums over blocks of 16+ vectors), leftover vectors to chain 0, the chains
// are folded 0 + 1 + 2 + 3, then the scalar tail is summed into a float that the V lanes are
// added to in order. Rows shorter than V are summed as scalars with the same four chains. The
// mean divides that sum by the row length. `sum_torch_order<V, square>` reproduces this order.
// V is whatever torch's build dispatches to (8 floats on AVX2 here); rather than assume it, each
// row length is calibrated once against torch's own pow + mean on random rows, and a length
// that matches no candidate keeps calling torch's mean.

constexpr int kChains = 4, kLevels = 4;

inline int64_t ceil_log2(int64_t v) {
  int64_t r = 0;
  while ((int64_t(1) << r) < v) ++r;
  return r;
}

}  // namespace (reopened below: the summation must not be contracted either)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

// Chains of W-wide elements: element e of chain c is elem(e * kChains + c). acc[c] gets the
// chain's sum, accumulated level by level as torch's multi_row_sum does.
template <int W, typename Elem>
void chain_sums(const Elem& elem, int64_t size, float (*out)[W]) {
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[kLevels][kChains][W] = {};
  float v[W];
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int c = 0; c < kChains; ++c) {
        elem(i * kChains + c, v);
        for (int l = 0; l < W; ++l) acc[0][c][l] = acc[0][c][l] + v[l];
      }
    for (int j = 1; j < kLevels; ++j) {
      for (int c = 0; c < kChains; ++c)
        for (int l = 0; l < W; ++l) {
          acc[j][c][l] = acc[j][c][l] + acc[j - 1][c][l];
          acc[j - 1][c][l] = 0.0f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int c = 0; c < kChains; ++c) {
      elem(i * kChains + c, v);
      for (int l = 0; l < W; ++l) acc[0][c][l] = acc[0][c][l] + v[l];
    }
  for (int j = 1; j < kLevels; ++j)
    for (int c = 0; c < kChains; ++c)
      for (int l = 0; l < W; ++l) acc[0][c][l] = acc[0][c][l] + acc[j][c][l];
  for (int c = 0; c < kChains; ++c)
    for (int l = 0; l < W; ++l) out[c][l] = acc[0][c][l];
}

// torch's row_sum: chains over the first size / 4 * 4 elements, the rest into chain 0, then fold.
template <int W, typename Elem>
void row_sum(const Elem& elem, int64_t size, float* out) {
  float chains[kChains][W] = {};
  const int64_t size_ilp = size / kChains;
  if (size_ilp > 0) chain_sums<W>(elem, size_ilp, chains);
  float v[W];
  for (int64_t i = size_ilp * kChains; i < size; ++i) {
    elem(i, v);
    for (int l = 0; l < W; ++l) chains[0][l] = chains[0][l] + v[l];
  }
  for (int c = 1; c < kChains; ++c)
    for (int l = 0; l < W; ++l) chains[0][l] = chains[0][l] + chains[c][l];
  for (int l = 0; l < W; ++l) out[l] = chains[0][l];
}

template <int V, bool Square>
__attribute__((noinline)) float sum_torch_order(const float* x, int64_t n) {
  auto value = [x](int64_t i) { return Square ? x[i] * x[i] : x[i]; };
  if (n < V) {
    float r;
    row_sum<1>([&value](int64_t i, float* v) { v[0] = value(i); }, n, &r);
    return 0.0f + r;
  }
  const int64_t vectors = n / V;
  float lanes[V];
  row_sum<V>(
      [&value](int64_t i, float* v) {
        for (int l = 0; l < V; ++l) v[l] = value(i * V + l);
      },
      vectors, lanes);
  float total = 0.0f;
  for (int64_t k = vectors * V; k < n; ++k) total = total + value(k);
  for (int l = 0; l < V; ++l) total = total + lanes[l];
  return 0.0f + total;
}

// The residual add, rounded as torch's `h + delta`: not contracted (this block), and not inlined, so
// that the setting holds wherever it is called from.
__attribute__((noinline)) void add_rows(float* h, const float* delta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = h[i] + delta[i];
}

}  // namespace
#pragma GCC pop_options
namespace {

// The first torch-order sum candidate (8, 16, then 4 lanes; of squares with `square`) for which
// reproduces(candidate) holds, or nullptr when none does.
template <class Reproduces>
SumFn first_reproducing(bool square, Reproduces reproduces) {
  const SumFn candidates[] = {square ? &sum_torch_order<8, true> : &sum_torch_order<8, false>,
                              square ? &sum_torch_order<16, true> : &sum_torch_order<16, false>,
                              square ? &sum_torch_order<4, true> : &sum_torch_order<4, false>};
  for (SumFn candidate : candidates)
    if (reproduces(candidate)) return candidate;
  return nullptr;
}

// The torch-order sum that reproduces torch's mean over rows of length D (of the squares with
// `square`, as pow(x, 2).mean(-1)), or nullptr when no candidate does. Calibrated once per
// length on rows of widely ranging values, where different orders disagree.
SumFn calibrated_sum(int64_t D, bool square) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, bool>, SumFn> chosen;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = chosen.find({D, square});
  if (it != chosen.end()) return it->second;
  const int64_t R = 64;
  auto x = torch::empty({R, D}, torch::kFloat32);
  float* xp = x.data_ptr<float>();
  uint64_t state = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(D);
  for (int64_t i = 0; i < R * D; ++i) {  // mantissas and exponents spread wide
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float u = static_cast<float>((state >> 40) & 0xFFFFFF) / 16777216.0f - 0.5f;
    xp[i] = std::ldexp(u, static_cast<int>((state >> 20) % 24) - 12);
  }
  auto expect = (square ? at::pow(x, 2) : x).mean({-1}, /*keepdim=*/true).contiguous();
  const float* ep = expect.data_ptr<float>();
  const SumFn result = first_reproducing(square, [&](SumFn candidate) {
    for (int64_t r = 0; r < R; ++r) {
      const float mine = candidate(xp + r * D, D) / static_cast<float>(D);
      if (std::memcmp(&mine, ep + r, sizeof(float)) != 0) return false;
    }
    return true;
  });
  chosen[{D, square}] = result;
  return result;
}

// Lanes of the torch-order sum of squares for rows of length D (0: torch's mean is called instead).
int64_t rms_sum_width(int64_t D) {
  const SumFn sum = calibrated_sum(D, true);
  return sum == &sum_torch_order<8, true> ? 8 : sum == &sum_torch_order<16, true> ? 16
                                               : sum == &sum_torch_order<4, true> ? 4 : 0;
}

}  // namespace

namespace moebench_cpu {

// The torch-order sum that reproduces torch's x.sum(-1) over the rows of an [N, k] float32 tensor,
// or nullptr when no candidate does. A reduction's order can depend on the tensor's shape, not only
// the row length, so it is calibrated per (k, N), on descending positive rows of widely ranging
// values (the top-k weights it sums), and on N rows at once as route_topk gets them.
SumFn calibrated_row_sum(int64_t k, int64_t N) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, SumFn> chosen;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = chosen.find({k, N});
  if (it != chosen.end()) return it->second;
  const int64_t rounds = std::max<int64_t>(1, 256 / N);
  auto x = torch::empty({rounds, N, k}, torch::kFloat32);
  float* xp = x.data_ptr<float>();
  uint64_t state = 0xD1B54A32D192ED03ull ^ static_cast<uint64_t>(k * 1000 + N);
  for (int64_t r = 0; r < rounds * N; ++r) {
    float previous = 1.0f;
    for (int64_t j = 0; j < k; ++j) {  // descending, each a random fraction of the one before
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>((state >> 40) & 0xFFFFFF) / 16777216.0f;
      previous = previous * (0.05f + 0.95f * u);
      xp[r * k + j] = previous;
    }
  }
  // torch's sums of N rows at once, as route_topk's caller would take them, round by round
  std::vector<float> expect(static_cast<size_t>(rounds * N));
  for (int64_t r = 0; r < rounds; ++r) {
    auto sums = x[r].sum({-1}, /*keepdim=*/true).contiguous();
    std::memcpy(expect.data() + r * N, sums.data_ptr<float>(), sizeof(float) * N);
  }
  const SumFn result = first_reproducing(false, [&](SumFn candidate) {
    for (int64_t i = 0; i < rounds * N; ++i) {
      const float mine = candidate(xp + i * k, k);
      if (std::memcmp(&mine, &expect[i], sizeof(float)) != 0) return false;
    }
    return true;
  });
  chosen[{k, N}] = result;
  return result;
}

// torch's float32 mean of x[0:n], as a contiguous tensor's mean() gives it.
float mean_torch_order(const float* x, int64_t n) {
  const bool split_row = n >= 32768 && at::get_num_threads() > 1;  // see mean_of_squares
  if (SumFn sum = split_row ? nullptr : calibrated_sum(n, false)) return sum(x, n) / static_cast<float>(n);
  return torch::from_blob(const_cast<float*>(x), {n}, torch::kFloat32).mean().item<float>();
}

// Mean of squares of each of R rows of x (row r at x + r * ld, D values): as torch's
// x.pow(2).mean(-1) gives it, into out[R].
void mean_of_squares(const float* x, int64_t R, int64_t D, int64_t ld, float* out) {
  // torch splits one long row over threads (a single output of 32768+ values): not this order
  const bool split_row = R == 1 && D >= 32768 && at::get_num_threads() > 1;
  if (SumFn sum = split_row ? nullptr : calibrated_sum(D, true)) {
    const float d = static_cast<float>(D);
    for (int64_t r = 0; r < R; ++r) out[r] = sum(x + r * ld, D) / d;
    return;
  }
  auto sq = torch::empty({R, D}, torch::kFloat32);
  float* s = sq.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) s[r * D + d] = x[r * ld + d] * x[r * ld + d];
  auto ms = at::mean(sq, {-1}).contiguous();
  std::copy(ms.data_ptr<float>(), ms.data_ptr<float>() + R, out);
}

// The elementwise steps of RMSNorm must round exactly as torch's ops do: no contraction of a
// product and a sum into one fused multiply-add. Not inlined, so that the setting holds for them
// wherever they are called from.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// out = (x * (1 / sqrt(ms + eps))) * w: F.rms_norm's float32 steps (add eps, rsqrt, two products).
__attribute__((noinline)) void normalize_row(const float* x, float ms, float eps, const float* w, float* out, int64_t D) {
  const float r = 1.0f / std::sqrt(ms + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = (x[d] * r) * w[d];
}
#pragma GCC pop_options

}  // namespace moebench_cpu

using moebench_cpu::mean_of_squares;
using moebench_cpu::normalize_row;

// h += delta (when given), then RMSNorm of h with weight w: h + delta and F.rms_norm as torch
// computes them. h [N, D] float32 contiguous is updated in place; returns the normalized [N, D].
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat32 && h.is_contiguous(),
              "add_rms_norm: h must be a contiguous float32 [N, D] tensor");
  const int64_t N = h.size(0), D = h.size(1);
  auto wc = w.to(torch::kFloat32).contiguous();
  TORCH_CHECK(wc.numel() == D, "add_rms_norm: weight must be [D]");
  torch::Tensor dc;
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == torch::kFloat32,
                "add_rms_norm: delta must be float32 of h's shape");
    dc = delta->contiguous();
  }
  std::vector<float> ms(N);
  auto out = torch::empty({N, D}, h.options());
  add_rms_norm_into(h.data_ptr<float>(), dc.defined() ? dc.data_ptr<float>() : nullptr, wc.data_ptr<float>(), N, D,
                    static_cast<float>(eps), out.data_ptr<float>(), ms.data());
  return out;
}

void add_rms_norm_into(float* h, const float* delta, const float* w, int64_t N, int64_t D, float eps, float* out,
                       float* ms) {
  if (delta != nullptr) add_rows(h, delta, N * D);
  mean_of_squares(h, N, D, D, ms);
  for (int64_t n = 0; n < N; ++n) normalize_row(h + n * D, ms[n], eps, w, out + n * D, D);
}

void register_norms(pybind11::module& m) {
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then RMSNorm of h (float32)");
  m.def("rms_sum_width", &rms_sum_width, "Lanes of the torch-order RMSNorm sum for rows of length D (0: torch's mean)");
}
