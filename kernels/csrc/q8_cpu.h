// Activations quantized to 8 bits per block of 32 values (the activations override "q8", issue 47,
// docs/int4.md): an APPROXIMATION, off unless asked for, applied to int4 rows and to int8 rows that
// carry a row scale (--weights int8, an int8 LM head). It is what llama.cpp does for its Q4_0 and Q8_0
// dot products (Q8_0 activations): the weight x activation products are summed in integers, and only
// one float multiply-add per block is left, where the weight-only kernels (int4_cpu.h, cpu_common.h)
// widen every weight to float32 and spend an FMA per weight on it.
//
// A token's row of K values (K a multiple of 32) is quantized once per op (q8_quantize_row): per
// block b, amax = max |x|, d = amax / 127, q = round-half-even(x * (127 / amax)) (0 where amax is 0),
// as ggml's AVX2 quantize_row_q8_0 does, except that d stays float32 (ggml stores a float16). Beside
// q it keeps offset[b] = 8 * (the block's sum of q): the weights' nibbles n are q4 + 8, and maddubs
// takes them unsigned, so sum(q4 * q) = sum(n * q) - offset.
//
// The dot of an int4 row with a quantized token, in this order and no other (the reference,
// kernels/reference.py: q4_q8_dot_reference, does the same float32 operations): per block b in order,
// the block's exact integer sum i_b, then acc = acc + float(i_b) * (d_w * d_x), three roundings, a
// multiply, a multiply, an add (the extension is built with -ffp-contract=off, so none is fused) --
// the order of ggml's scalar vec_dot_q4_0_q8_0. The kernel takes eight rows at once, one float32 lane
// each: a block's integer sums of eight rows are reduced into one vector with packs and madds (every
// partial sum of at most 16 products of |n| <= 15 and |q| <= 127 fits an int16: 16 * 1905 = 30480),
// so the float work per block is one conversion, two multiplies and an add for the eight rows, and no
// horizontal sum is left at the end of a row. Bound at one token by the integer multiplies (two per
// row and block) rather than by the bytes it reads.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace moebench_cpu {

// Whether int4 and int8 weights meet q8 activations in this process (set_activations, dense_cpu.cpp;
// the activations override), and the rows counted where the q8 kernels ran: weight rows dotted with q8
// tokens, activation rows quantized (simd_stats: the evidence that the switch did something).
bool q8_activations();
extern std::atomic<int64_t> g_q8_weight_rows;
extern std::atomic<int64_t> g_q8_activation_rows;

// Quantized tokens of one op: q [N][K] int8, d [N][K / 32] float32, offset [N][K / 32] int32.
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
    offset_.resize(static_cast<size_t>(N * (K / 32)));
  }
  void quantize(int64_t row, const float* x);  // below
  const int8_t* q(int64_t row) const { return q_.data() + row * K_; }
  const float* d(int64_t row) const { return d_.data() + row * (K_ / 32); }
  const int32_t* offset(int64_t row) const { return offset_.data() + row * (K_ / 32); }
  int64_t K() const { return K_; }

 private:
  int64_t K_ = 0;
  std::vector<int8_t> q_;
  std::vector<float> d_;
  std::vector<int32_t> offset_;
};

MOEBENCH_Q4_TARGET inline void q8_quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* offset) {
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
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      sum += qi[i];
      q[32 * b + i] = static_cast<int8_t>(qi[i]);
    }
    offset[b] = 8 * sum;
  }
}

inline void Q8Tokens::quantize(int64_t row, const float* x) {
  q8_quantize_row(x, K_, q_.data() + row * K_, d_.data() + row * (K_ / 32), offset_.data() + row * (K_ / 32));
}

// Eight rows' block scales (the float16 at offset `at` of each row) as float32 lanes 0-7. Inserted
// into a register one by one: eight 2-byte stores read back as one 16-byte load would stall on store
// forwarding in every block.
MOEBENCH_Q4_TARGET inline __m256 q4_scales8(const Q4* const* w, int64_t at) {
  __m128i h = _mm_setzero_si128();
  auto scale = [&](int r) {
    uint16_t v;
    std::memcpy(&v, w[r] + at, sizeof v);
    return static_cast<int>(v);
  };
  h = _mm_insert_epi16(h, scale(0), 0);
  h = _mm_insert_epi16(h, scale(1), 1);
  h = _mm_insert_epi16(h, scale(2), 2);
  h = _mm_insert_epi16(h, scale(3), 3);
  h = _mm_insert_epi16(h, scale(4), 4);
  h = _mm_insert_epi16(h, scale(5), 5);
  h = _mm_insert_epi16(h, scale(6), 6);
  h = _mm_insert_epi16(h, scale(7), 7);
  return _mm256_cvtph_ps(h);
}

// Lane r of the result: the sum of the eight int32 lanes of m[r]. Two levels of packs (int32 to int16,
// exact for the partial sums above) and madds with ones (adjacent pairs to int32), then the two
// 128-bit halves added: lanes 0-3 of a0123 hold rows 0-3's low-half sums, lanes 4-7 their high-half.
MOEBENCH_Q4_TARGET inline __m256i q4q8_row_sums8(const __m256i (&m)[8]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i a01 = _mm256_madd_epi16(_mm256_packs_epi32(m[0], m[1]), ones);
  const __m256i a23 = _mm256_madd_epi16(_mm256_packs_epi32(m[2], m[3]), ones);
  const __m256i a45 = _mm256_madd_epi16(_mm256_packs_epi32(m[4], m[5]), ones);
  const __m256i a67 = _mm256_madd_epi16(_mm256_packs_epi32(m[6], m[7]), ones);
  const __m256i a0123 = _mm256_madd_epi16(_mm256_packs_epi32(a01, a23), ones);
  const __m256i a4567 = _mm256_madd_epi16(_mm256_packs_epi32(a45, a67), ones);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a0123, a4567, 0x20),
                          _mm256_permute2x128_si256(a0123, a4567, 0x31));
}

// o[r * T + t] = dot(int4 row w[r], quantized token t) for 8 rows and T tokens (see the top).
template <int T>
MOEBENCH_Q4_TARGET void q4q8_dot8(const Q4* const* w, const int8_t* const* xq, const float* const* xd,
                                  const int32_t* const* xoff, int64_t K, float* o) {
  constexpr int R = 8;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  // one 16-byte load into both halves; the upper half shifted by 4: bytes 0-15 the low nibbles
  // (values 0-15), bytes 16-31 the high nibbles (values 16-31)
  const __m256i low = _mm256_set1_epi8(0x0F), high_half = _mm256_set_epi64x(4, 4, 0, 0), ones = _mm256_set1_epi16(1);
  for (int64_t k = 0, b = 0; k < K; k += kQ4Values, ++b) {
    __m256i n[R];
    for (int r = 0; r < R; ++r) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + b * kQ4Bytes + 2));
      n[r] = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(raw), high_half), low);
    }
    const __m256 dw = q4_scales8(w, b * kQ4Bytes);
    for (int t = 0; t < T; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + k));
      __m256i m[R];
      for (int r = 0; r < R; ++r) m[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(n[r], x), ones);
      const __m256i isum = _mm256_sub_epi32(q4q8_row_sums8(m), _mm256_set1_epi32(xoff[t][b]));
      const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(xd[t][b]));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), d));
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float lanes[R];
    _mm256_store_ps(lanes, acc[t]);
    for (int r = 0; r < R; ++r) o[r * T + t] = lanes[r];
  }
}

// int8 rows (row-scaled: the scale is the caller's, applied to the sum): the same eight-row shape. maddubs
// needs one unsigned operand, so it takes |w| and q with w's sign (llama.cpp's AVX2 Q8_0 trick): |w| <=
// 128 and |q| <= 127 keep each pair's sum in an int16 (32512), exact. A lane's 4 products can reach
// 65024, past an int16, so the eight rows' lanes are reduced in int32 instead of packs: by unpacks and
// adds (a transpose), not hadds, which issue one per two cycles on Zen 3 (benchmarks/instruction_rates.cpp).
// Per block in order acc = acc + float(i_b) * d_x: the sum then goes through the row's scale like the
// weight-only kernel's (kernels/reference.py: i8_q8_dot_reference).
MOEBENCH_Q4_TARGET inline __m256i i8q8_row_sums8(const __m256i (&m)[8]) {
  // two rows' lanes pairwise, then four rows': per 128-bit half, lane j holds row j's (of 4) half-sum
  auto two = [](__m256i a, __m256i b) { return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b)); };
  auto four = [](__m256i a, __m256i b) { return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b)); };
  const __m256i s0123 = four(two(m[0], m[1]), two(m[2], m[3]));
  const __m256i s4567 = four(two(m[4], m[5]), two(m[6], m[7]));
  // lanes 0-3: rows 0-3's halves added; lanes 4-7: rows 4-7's
  return _mm256_add_epi32(_mm256_blend_epi32(s0123, s4567, 0xF0), _mm256_permute2x128_si256(s0123, s4567, 0x21));
}

template <int T>
MOEBENCH_Q4_TARGET void i8q8_dot8(const int8_t* const* w, const int8_t* const* xq, const float* const* xd, int64_t K,
                                  float* o) {
  constexpr int R = 8;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0, b = 0; k < K; k += kQ4Values, ++b) {
    __m256i wv[R], magnitude[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k));
      magnitude[r] = _mm256_abs_epi8(wv[r]);
    }
    for (int t = 0; t < T; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + k));
      __m256i m[R];
      for (int r = 0; r < R; ++r)
        m[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[r], _mm256_sign_epi8(x, wv[r])), ones);
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(i8q8_row_sums8(m)), _mm256_set1_ps(xd[t][b])));
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float lanes[R];
    _mm256_store_ps(lanes, acc[t]);
    for (int r = 0; r < R; ++r) o[r * T + t] = lanes[r];
  }
}

// The functions below carry the kernels' target too, so that a whole item's groups inline into one
// function: called from code built without F16C, each group of eight rows was a call of its own.
template <int T, typename W>
MOEBENCH_Q4_TARGET inline void q8_dot8_tokens(const W* const* w, const Q8Tokens& x, const int64_t* tokens, float* o) {
  const int8_t* xq[T];
  const float* xd[T];
  const int32_t* xoff[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = x.q(tokens[t]);
    xd[t] = x.d(tokens[t]);
    xoff[t] = x.offset(tokens[t]);
  }
  if constexpr (std::is_same_v<W, Q4>) q4q8_dot8<T>(w, xq, xd, xoff, x.K(), o);
  else i8q8_dot8<T>(w, xq, xd, x.K(), o);  // int8 rows carry their sign into q: no offset
}

// Eight rows (int4 or int8) with every token, 3 tokens at a time while the rows stay in L1:
// put(t0, m, os) with os[r * m + t - t0].
template <typename W, typename Put>
MOEBENCH_Q4_TARGET inline void q8_dot8_group(const W* const* w, const Q8Tokens& x, const int64_t* tokens, int64_t n, Put&& put) {
  float os[8 * 3];
  for (int64_t t0 = 0; t0 < n; t0 += 3) {
    const int64_t m = std::min<int64_t>(3, n - t0);
    if (m == 1) q8_dot8_tokens<1>(w, x, tokens + t0, os);
    else if (m == 2) q8_dot8_tokens<2>(w, x, tokens + t0, os);
    else q8_dot8_tokens<3>(w, x, tokens + t0, os);
    put(t0, m, os);
  }
}

// o[i * n + t] = dot(row(i), token tokens[t]) for rows i in [0, rows) and n tokens (rows of x); `row`
// returns a `const Q4*` or a `const int8_t*` (an int8 row's sum is not scaled here). The rows are read
// as eight runs side by side, as dot_rows_streamed reads its runs (cpu_common.h), one row of each run
// with every token; the rows left over (fewer than 8) go as one group whose missing rows repeat
// the last one, their sums dropped.
template <typename Row>
MOEBENCH_Q4_TARGET void q8_dot_rows(Row row, int64_t rows, const Q8Tokens& x, const int64_t* tokens, int64_t n, float* o) {
  using W = std::remove_const_t<std::remove_pointer_t<decltype(row(0))>>;
  constexpr int R = 8;
  const int64_t q = rows / R;
  g_q8_weight_rows.fetch_add(rows, std::memory_order_relaxed);
  for (int64_t i = 0; i < q; ++i) {
    // run r at its row (i + r) mod q in step i: runs whose starts lie a multiple of 4 KiB apart (q * row
    // bytes) would otherwise put the eight rows' lines of a block, and the tokens', in one L1 set
    auto at = [&](int r) {
      const int64_t j = i + r;
      return r * q + (j < q ? j : j - q < q ? j - q : j % q);
    };
    const W* w[R];
    for (int r = 0; r < R; ++r) w[r] = row(at(r));
    q8_dot8_group(w, x, tokens, n, [&](int64_t t0, int64_t m, const float* os) {
      for (int r = 0; r < R; ++r)
        for (int64_t t = 0; t < m; ++t) o[at(r) * n + t0 + t] = os[r * m + t];
    });
  }
  const int64_t left = rows - R * q;
  if (left == 0) return;
  const W* w[R];
  for (int r = 0; r < R; ++r) w[r] = row(R * q + std::min<int64_t>(r, left - 1));
  q8_dot8_group(w, x, tokens, n, [&](int64_t t0, int64_t m, const float* os) {
    for (int64_t r = 0; r < left; ++r)
      for (int64_t t = 0; t < m; ++t) o[(R * q + r) * n + t0 + t] = os[r * m + t];
  });
}

}  // namespace moebench_cpu
