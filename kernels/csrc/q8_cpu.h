// Activations quantized to 8 bits per block of 32 values (the activations override "q8", issue 47,
// docs/int4.md): an APPROXIMATION, off unless asked for, applied to int4 weights only. It is what
// llama.cpp does for its Q4_0 dot products (Q8_0 activations): the int4 x int8 products are summed in
// integers, and only one float multiply-add per block and token is left, where the weight-only kernels
// (int4_cpu.h) widen every weight to float32 and spend an FMA per weight on it. At one token the
// weight-only int4 kernel is bound by those instructions, not by the bytes it reads.
//
// A token's row of K values (K a multiple of 32) is quantized once per op (q8_quantize_row): per
// block b, amax = max |x|, d = amax / 127, q = round-half-even(x * (127 / amax)) (0 where amax is 0),
// as ggml's AVX2 quantize_row_q8_0 does, except that d stays float32 (ggml stores a float16). Beside
// q it keeps s8[b][j] = 8 * (q[4j] + ... + q[4j + 3]): the weights' nibbles n are q4 + 8, and
// maddubs takes them unsigned, so sum(q4 * q) = sum(n * q) - 8 * sum(q), lane by lane.
//
// The dot of an int4 row with a quantized token, in this order and no other (the reference,
// kernels/reference.py: q4_q8_dot_reference, does the same float32 operations): eight float32 lanes,
// lane j taking values 4j..4j+3 of each block; per block, its lane's exact integer sum i_j, then
// acc_j = acc_j + float(i_j) * (d_w * d_x): three roundings, a multiply, a multiply, an add (the
// extension is built with -ffp-contract=off, so none is fused); then hsum's order (cpu_common.h).
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace moebench_cpu {

// Whether int4 weights meet q8 activations in this process (set_activations, pool.cpp; the
// activations override), and the rows counted where the q8 kernels ran: weight rows dotted with q8
// tokens, activation rows quantized (simd_stats: the evidence that the switch did something).
bool q8_activations();
extern std::atomic<int64_t> g_q8_weight_rows;
extern std::atomic<int64_t> g_q8_activation_rows;

// Quantized tokens of one op: q [N][K] int8, d [N][K / 32] float32, s8 [N][K / 32][8] int32.
class Q8Tokens {
 public:
  Q8Tokens() = default;
  Q8Tokens(const Q8Tokens&) = delete;
  Q8Tokens& operator=(const Q8Tokens&) = delete;

  // Sizes the buffers for N rows of K values (kept between calls: one op after another reuses them).
  void resize(int64_t N, int64_t K) {
    K_ = K;
    q_.resize(static_cast<size_t>(N * K));
    d_.resize(static_cast<size_t>(N * (K / 32)));
    s8_.resize(static_cast<size_t>(N * (K / 32) * 8));
  }
  void quantize(int64_t row, const float* x);  // below
  const int8_t* q(int64_t row) const { return q_.data() + row * K_; }
  const float* d(int64_t row) const { return d_.data() + row * (K_ / 32); }
  const int32_t* s8(int64_t row) const { return s8_.data() + row * (K_ / 32) * 8; }
  int64_t K() const { return K_; }

 private:
  int64_t K_ = 0;
  std::vector<int8_t> q_;
  std::vector<float> d_;
  std::vector<int32_t> s8_;
};

MOEBENCH_Q4_TARGET inline void q8_quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s8) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = 0.0f;
    for (float l : lanes) amax = l > amax ? l : amax;
    d[b] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    alignas(32) int32_t qi[32];
    for (int j = 0; j < 4; ++j)
      _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * j),
                         _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    for (int j = 0; j < 8; ++j) {
      s8[8 * b + j] = 8 * (qi[4 * j] + qi[4 * j + 1] + qi[4 * j + 2] + qi[4 * j + 3]);
      for (int i = 0; i < 4; ++i) q[32 * b + 4 * j + i] = static_cast<int8_t>(qi[4 * j + i]);
    }
  }
}

inline void Q8Tokens::quantize(int64_t row, const float* x) {
  q8_quantize_row(x, K_, q_.data() + row * K_, d_.data() + row * (K_ / 32), s8_.data() + row * (K_ / 32) * 8);
}

// o[s * T + t] = dot(int4 row w[s], quantized token t) for S rows and T tokens (see the top).
template <int S, int T>
MOEBENCH_Q4_TARGET void q4q8_dot(const Q4* const* w, const int8_t* const* xq, const float* const* xd,
                                 const int32_t* const* xs, int64_t K, float* o) {
  __m256 acc[S][T];
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < T; ++t) acc[s][t] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t k = 0, b = 0; k < K; k += kQ4Values, ++b) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const Q4* block = w[s] + b * kQ4Bytes;
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
      // bytes 0-15: the low nibbles (values 0-15), bytes 16-31: the high nibbles (values 16-31)
      const __m256i n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      const __m256 dw = _mm256_set1_ps(q4_scale(block));
#pragma GCC unroll 3
      for (int t = 0; t < T; ++t) {
        const __m256i pairs = _mm256_maddubs_epi16(n, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + k)));
        const __m256i isum = _mm256_sub_epi32(_mm256_madd_epi16(pairs, ones),
                                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[t] + 8 * b)));
        const __m256 d = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd[t] + b));
        acc[s][t] = _mm256_add_ps(acc[s][t], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), d));
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < T; ++t) o[s * T + t] = hsum(acc[s][t]);
}

template <int S, int T>
inline void q4q8_dot_tokens(const Q4* const* w, const Q8Tokens& x, const int64_t* tokens, float* o) {
  const int8_t* xq[T];
  const float* xd[T];
  const int32_t* xs[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = x.q(tokens[t]);
    xd[t] = x.d(tokens[t]);
    xs[t] = x.s8(tokens[t]);
  }
  q4q8_dot<S, T>(w, xq, xd, xs, x.K(), o);
}

template <int S>
inline void q4q8_dot_group(const Q4* const* w, const Q8Tokens& x, const int64_t* tokens, int64_t n, float* o) {
  if (n == 1) q4q8_dot_tokens<S, 1>(w, x, tokens, o);
  else if (n == 2) q4q8_dot_tokens<S, 2>(w, x, tokens, o);
  else q4q8_dot_tokens<S, 3>(w, x, tokens, o);
}

// o[i * n + t] = dot(row(i), token tokens[t]) for rows i in [0, rows) and n tokens (rows of x). The
// rows are read as four runs side by side, as dot_rows_streamed reads them (cpu_common.h), the i-th
// row of each run with every token, 3 tokens at a time: the 4 rows stay in L1 while the groups pass.
template <typename Row>
inline void q4q8_dot_rows(Row row, int64_t rows, const Q8Tokens& x, const int64_t* tokens, int64_t n, float* o) {
  constexpr int S = 4;
  const int64_t q = rows / S;
  g_q8_weight_rows.fetch_add(rows, std::memory_order_relaxed);
  float os[S * 3];
  for (int64_t i = 0; i < q; ++i) {
    const Q4* w[S];
    for (int s = 0; s < S; ++s) w[s] = row(s * q + i);
    for (int64_t t0 = 0; t0 < n; t0 += 3) {
      const int64_t m = std::min<int64_t>(3, n - t0);
      q4q8_dot_group<S>(w, x, tokens + t0, m, os);
      for (int s = 0; s < S; ++s)
        for (int64_t t = 0; t < m; ++t) o[(s * q + i) * n + t0 + t] = os[s * m + t];
    }
  }
  for (int64_t i = S * q; i < rows; ++i) {
    const Q4* w = row(i);
    for (int64_t t0 = 0; t0 < n; t0 += 3) {
      const int64_t m = std::min<int64_t>(3, n - t0);
      q4q8_dot_group<1>(&w, x, tokens + t0, m, os);
      for (int64_t t = 0; t < m; ++t) o[i * n + t0 + t] = os[t];
    }
  }
}

}  // namespace moebench_cpu
