// The router's decode-step ops on the CPU: the softmax router's top-k (`route_topk`) and a step's
// routing summary (`routing_step_summary`). Each computes what the torch ops it replaces compute,
// bit for bit: both end in a reduction (the sum of a row's top-k weights, the mean of a step's
// imbalances), which adds in the order torch's sum takes for that shape (norms_cpu.h: calibrated
// against torch once per shape), or is left to torch where no candidate order reproduces it.

#include "ops.h"
#include "distinct_experts.h"
#include "norms_cpu.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

using moebench_cpu::calibrated_row_sum;
using moebench_cpu::mean_torch_order;
using moebench_cpu::SumFn;

// Softmax router's top-k on probabilities [N, E] float32: the k largest per row, descending,
// equal values ordered by the lower expert index (a stable descending sort's first k), NaN
// above every number as torch sorts it. With `renormalize`, each weight is divided by the sum
// of the row's k weights: for k <= 2 a single rounded addition (any order gives it), beyond in the
// order torch's sum takes for this shape (calibrated_row_sum), or by torch itself where no order
// reproduces it.
std::vector<torch::Tensor> route_topk(torch::Tensor probs, int64_t k, bool renormalize) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32, "route_topk: probs must be float32 [N, E]");
  const int64_t N = probs.size(0), E = probs.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "route_topk: top_k=", k, " with ", E, " experts");
  auto p = probs.contiguous();
  auto weights = torch::empty({N, k}, p.options());
  auto ids = torch::empty({N, k}, p.options().dtype(torch::kInt64));
  if (!route_topk_into(p.data_ptr<float>(), N, E, k, renormalize, weights.data_ptr<float>(), ids.data_ptr<int64_t>()))
    renormalize_by_torch(weights);
  return {weights, ids};
}

void renormalize_by_torch(torch::Tensor& weights) {
  weights.copy_(weights / weights.sum({-1}, /*keepdim=*/true));  // the reference's own ops
}

bool route_topk_into(const float* pp, int64_t N, int64_t E, int64_t k, bool renormalize, float* wp, int64_t* ip) {
  const SumFn torch_sum = renormalize && k > 2 ? calibrated_row_sum(k, N) : nullptr;
  const bool torch_divides = renormalize && k > 2 && torch_sum == nullptr;
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
    if (renormalize && !torch_divides) {
      const float sum = torch_sum != nullptr ? torch_sum(w, k) : k == 1 ? w[0] : w[0] + w[1];
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / sum;
    }
  }
  return !torch_divides;
}

// A step's routing summary, as RoutingStats computed it with torch ops: ids[r] [tokens, k] int64
// are the experts MoE call r chose, for layer layers[r]; load [layers, E] int64 gets each call's
// per-expert token counts added. Returns (mean over calls of the distinct experts, mean over calls
// of max count * distinct / tokens routed), float32 values as torch's float32 means give them.
std::tuple<double, double> routing_step_summary(std::vector<torch::Tensor> ids, std::vector<int64_t> layers,
                                                torch::Tensor load) {
  TORCH_CHECK(load.dim() == 2 && load.scalar_type() == torch::kInt64 && load.is_contiguous(),
              "routing_step_summary: load must be a contiguous int64 [layers, experts] tensor");
  const int64_t rows = static_cast<int64_t>(ids.size()), E = load.size(1);
  TORCH_CHECK(rows > 0 && static_cast<int64_t>(layers.size()) == rows,
              "routing_step_summary: one layer per call, at least one call");
  std::vector<int64_t> counts(E);
  std::vector<float> imbalance(rows);
  moebench_experts::DistinctExperts experts;
  experts.resize(E);
  int64_t distinct_total = 0;
  int64_t* lp = load.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(layers[r] >= 0 && layers[r] < load.size(0), "routing_step_summary: layer ", layers[r], " out of range");
    auto t = ids[r].to(torch::kInt64).contiguous();
    const int64_t* ip = t.data_ptr<int64_t>();
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < t.numel(); ++i) {
      TORCH_CHECK(ip[i] >= 0 && ip[i] < E, "routing_step_summary: expert id ", ip[i], " out of range");
      ++counts[ip[i]];
    }
    const int64_t distinct = experts.mark(ip, t.numel());
    int64_t most = 0, total = 0;
    for (int64_t e = 0; e < E; ++e) {
      lp[layers[r] * E + e] += counts[e];
      most = std::max(most, counts[e]);
      total += counts[e];
    }
    distinct_total += distinct;
    // torch: int64 product, true division of int64 tensors in float32
    imbalance[r] = static_cast<float>(most * distinct) / static_cast<float>(total);
  }
  const float distinct_mean = static_cast<float>(distinct_total) / static_cast<float>(rows);  // exact sum of ints
  return {distinct_mean, mean_torch_order(imbalance.data(), rows)};
}

// Whether route_topk renormalizes N rows of k weights in its own loop (else it calls torch's
// weights / weights.sum(-1) for them): the summation order is reproduced for this shape.
bool topk_sum_matches_torch(int64_t k, int64_t N) { return k <= 2 || calibrated_row_sum(k, N) != nullptr; }

void register_routing(pybind11::module& m) {
  m.def("route_topk", &route_topk, "Top-k of router probabilities, ties to the lower index (float32)");
  m.def("topk_sum_matches_torch", &topk_sum_matches_torch,
        "Whether route_topk renormalizes N rows of k weights as torch's sum does");
  m.def("routing_step_summary", &routing_step_summary, "A step's routing counts, load update and summary");
}
