// What the CPU kernels of the moebench_moe_cpu extension share: the decode step's thread pool
// (defined in dense_cpu.cpp) and the AVX2 loads that widen bfloat16 weights in registers.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace moebench_cpu {

// fn(context, i) for i in [0, n) on up to `threads` threads of the step's pool, the caller
// included, which waits only for items other threads claimed.
void parallel_run(int64_t n, int threads, void (*fn)(void*, int64_t), void* context);
int step_threads();  // the pool's thread count for this step

template <class F>
void parallel_for(int64_t n, int threads, F&& f) {
  parallel_run(n, threads, [](void* c, int64_t i) { (*static_cast<std::remove_reference_t<F>*>(c))(i); }, &f);
}

// ---- loads: 8 weights as float32 -------------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen the 16-bit lanes to 32 bits and shift.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace moebench_cpu

// The decode step's ops that decode_layer.cpp chains into one call each (defined in dense_cpu.cpp
// and attention_cpu.cpp, where their contracts are written).
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor decode_attention_block(torch::Tensor qkv, c10::optional<torch::Tensor> q_norm,
                                     c10::optional<torch::Tensor> k_norm, double eps, torch::Tensor cos,
                                     torch::Tensor sin, torch::Tensor positions, torch::Tensor k, torch::Tensor v,
                                     torch::Tensor slots, torch::Tensor blocks, torch::Tensor lens, int64_t block_size,
                                     double scale, int64_t window, int64_t num_heads);
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps);
std::vector<torch::Tensor> route_topk(torch::Tensor probs, int64_t k, bool renormalize);
