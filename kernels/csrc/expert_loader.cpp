// The native expert loader's Python module: the loader and its tickets (expert_loader.h), the native
// store (expert_store.cpp) and the prefetcher's guess.
#include "expert_loader.h"

namespace py = pybind11;
using namespace moebench_loader;

namespace {

// The experts a router is expected to pick for a few tokens: the top `k` of h @ w_t per token,
// distinct, in token order (each token's surest first). w_t is the router transposed, [H, E], so
// the inner loop runs over experts and vectorises without reordering any sum. One call instead of
// a matmul, a top-k and a host copy through the dispatcher, each of which costs far more than its
// arithmetic inside a decode step (its code is cold after the layer's kernel; docs/prefetch.md).
// Large inputs go to ATen's matmul.
py::list guess_experts(torch::Tensor h, torch::Tensor w_t, int64_t k) {
  TORCH_CHECK(h.dim() == 2 && w_t.dim() == 2 && h.size(1) == w_t.size(0), "guess_experts: h [B, H], w_t [H, E]");
  TORCH_CHECK(h.scalar_type() == torch::kFloat32 && w_t.scalar_type() == torch::kFloat32, "guess_experts: float32");
  const int64_t B = h.size(0), H = h.size(1), E = w_t.size(1);
  k = std::min(k, E);
  std::vector<float> logits(static_cast<size_t>(B * E), 0.0f);
  if (B * H * E <= (int64_t(1) << 21)) {
    auto hc = h.contiguous();
    auto wc = w_t.contiguous();
    const float* hp = hc.data_ptr<float>();
    const float* wp = wc.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float* out = logits.data() + b * E;
      const float* x = hp + b * H;
      for (int64_t i = 0; i < H; ++i) {
        const float xi = x[i];
        const float* row = wp + i * E;
        for (int64_t e = 0; e < E; ++e) out[e] += xi * row[e];
      }
    }
  } else {
    auto l = at::mm(h.contiguous(), w_t).contiguous();
    std::memcpy(logits.data(), l.data_ptr<float>(), sizeof(float) * B * E);
  }
  std::vector<char> seen(static_cast<size_t>(E), 0);
  std::vector<int64_t> order;
  std::vector<int64_t> top(static_cast<size_t>(k));
  for (int64_t b = 0; b < B; ++b) {
    const float* row = logits.data() + b * E;
    // k is small: k passes of a max search (ties: the lower expert id, as a stable top-k would)
    for (int64_t r = 0; r < k; ++r) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < r; ++q) taken |= top[q] == e;
        if (!taken && (best < 0 || row[e] > row[best])) best = e;
      }
      top[r] = best;
      if (!seen[best]) {
        seen[best] = 1;
        order.push_back(best);
      }
    }
  }
  py::list out;
  for (int64_t e : order) out.append(e);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::register_exception<LoadError>(m, "LoadError");
  register_store(m);
  m.def("guess_experts", &guess_experts, py::arg("h"), py::arg("w_t"), py::arg("k"),
        "Distinct top-k experts of h @ w_t over the tokens, in token order (a prefetch guess).");
  py::class_<Ticket>(m, "Ticket")
      .def("cancel", &Ticket::cancel, "Cancel the load if it has not started; True if it will never run.")
      .def("done", &Ticket::done, "Whether the load ended (copied, failed or cancelled).")
      .def("result", &Ticket::result, "Wait for the load (GIL released); raise LoadError if it failed.");
  py::class_<Loader>(m, "Loader")
      .def(py::init<int, int64_t, const std::vector<int>&>(), py::arg("threads"), py::arg("spin_us") = 0,
           py::arg("cpus") = std::vector<int>{},
           "threads: workers (0: run() only); spin_us: how long an idle worker (one at a time), or a thread "
           "waiting for a load, spins before it sleeps; cpus: the cores the workers may run on (empty: any)")
      .def("submit", &Loader::submit, "Queue loads; one ticket each, in order.")
      .def("run", &Loader::run, "Run loads now in the calling thread, GIL released.")
      .def("hold", &Loader::hold)
      .def("close", &Loader::close)
      .def_property_readonly("reads", &Loader::reads, "File reads done so far.")
      .def_property_readonly("bytes_read", &Loader::bytes_read, "Bytes those reads returned.");
}
