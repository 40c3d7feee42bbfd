// int4 rows (--weights int4, docs/int4.md): llama.cpp's Q4_0 blocks, byte for byte. A row of K values
// (K a multiple of 32) is K / 32 blocks of 18 bytes: a float16 scale d, then 16 bytes whose low nibbles
// are the block's values 0-15 and high nibbles its values 16-31, each stored as q + 8 with q in [-8, 7];
// the value is q * d (engine/quantize.py: pack_int4_rows; kernels/reference.py: dequantize_int4_rows).
//
// The kernels widen a block in registers into its 32 values q * d (exact in float32: a 4-bit integer
// times a float16) and then do exactly what they do with float32 weights: the same accumulators, the
// same FMAs in the same order. So an int4 kernel's result equals the float32 kernel's on the
// dequantized weights (bit for bit but for the sign of an exact zero: q4_half8), and the AVX-512
// twin's is the AVX2 kernel's bit for bit (tests/kernels/test_int4_kernels.py).
// Scaling each block's partial sum instead (one multiply per block rather than per 8 values) would
// save 4 multiplies per 32 weights and lose both of those identities.
//
// `Q4` is a byte that stands for int4 rows in the kernels' templates: a row pointer is a `const Q4*`
// and row strides are in bytes, as for int8 rows; within a row only whole blocks are addressed. The
// overloads below (dot_streams, dot_tile) are what those templates pick for Q4 rows.
//
// Included at the end of cpu_common.h, whose RowSum, hsum and avx512_streams it uses.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace moebench_cpu {

struct Q4 {
  uint8_t byte;
};
constexpr int64_t kQ4Values = 32;  // values per block
constexpr int64_t kQ4Bytes = 18;   // bytes per block

// The bytes of a row of K values (K a multiple of kQ4Values).
constexpr int64_t q4_row_bytes(int64_t K) { return K / kQ4Values * kQ4Bytes; }

// Every AVX2 CPU has F16C (Ivy Bridge and Piledriver on); the extension is built for AVX2 and FMA
// only, so the int4 functions ask for it themselves. Called, not inlined, from the other kernels.
#define MOEBENCH_Q4_TARGET __attribute__((target("avx2,fma,f16c")))
#define MOEBENCH_Q4_AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))

// A block's float16 scale as float32 (exact).
MOEBENCH_Q4_TARGET inline float q4_scale(const Q4* block) {
  uint16_t h;
  std::memcpy(&h, block, sizeof h);
  return _cvtsh_ss(h);
}

// Eight bytes of a block's nibbles (bytes 0-7 or 8-15) widened to 32-bit lanes: the low nibbles are
// values j, the high nibbles values 16 + j. Each value as float32: (n - 8) * d = n * d - 8 d, one FMA,
// exact (the product is representable, so its one rounding changes nothing): q * d's value, though a
// zero comes out +0 where q * d is -0 for a negative d; that changes a sum only where it is exactly 0,
// and then only its sign. (q * d itself would cost an integer subtract and a multiply: 9 instructions
// per 16 values instead of 7, in a loop bound by instructions.)
MOEBENCH_Q4_TARGET inline void q4_half8(const Q4* bytes8, __m256 d, __m256 minus8d, __m256& lo, __m256& hi) {
  const __m256i n = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes8)));
  lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(n, _mm256_set1_epi32(0x0F))), d, minus8d);
  hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(n, 4)), d, minus8d);
}

// The block's 32 values q * d as four 8-lane vectors (values 0-7, 8-15, 16-23, 24-31).
MOEBENCH_Q4_TARGET inline void q4_block8(const Q4* block, __m256 (&v)[4]) {
  const __m256 d = _mm256_set1_ps(q4_scale(block)), minus8d = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  q4_half8(block + 2, d, minus8d, v[0], v[2]);
  q4_half8(block + 10, d, minus8d, v[1], v[3]);
}

// Values [k0, k1) of a row (multiples of 32) into dst as float32: the tiles of 4+ tokens widen a chunk
// of rows into L1 once and run the float32 tile on it, as for int8 rows.
MOEBENCH_Q4_TARGET inline void q4_widen(const Q4* row, int64_t k0, int64_t k1, float* dst) {
  for (int64_t k = k0; k < k1; k += kQ4Values) {
    __m256 v[4];
    q4_block8(row + k / kQ4Values * kQ4Bytes, v);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + k - k0 + 8 * j, v[j]);
  }
}

// ---- the streamed dots of 1-3 tokens (cpu_common.h: dot_streams), for Q4 rows --------------------
//
// The float32 kernel's accumulators, U per (stream, token): accumulator u takes the 8-value groups
// u, u + U, u + 2U, ... of the row, in that order; a block is 4 such groups.
template <RowSum F, int S, int U, int T>
inline void q4_finish(__m256 (&acc)[S][U][T], float* o) {
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < T; ++t) {
      __m256 v = acc[s][0][t];
      for (int u = 1; u < U; ++u) v = _mm256_add_ps(v, acc[s][u][t]);  // kDense: U is 2, as its combine
      o[s * T + t] = hsum(v);
    }
}

template <RowSum F, int S, int T>
MOEBENCH_Q4_TARGET void q4_dot_streams_avx2(const Q4* const* w, const float* const* x, int64_t K, float* o) {
  constexpr int U = F == RowSum::kDense ? 2 : (T == 1 ? 4 : 2);
  __m256 acc[S][U][T];
  for (int s = 0; s < S; ++s)
    for (int u = 0; u < U; ++u)
      for (int t = 0; t < T; ++t) acc[s][u][t] = _mm256_setzero_ps();
  for (int64_t k = 0, b = 0; k < K; k += kQ4Values, b += kQ4Bytes) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const __m256 d = _mm256_set1_ps(q4_scale(w[s] + b)), minus8d = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // bytes 0-7 (values 0-7, 16-23), then 8-15 (values 8-15, 24-31)
        __m256 lo, hi;
        q4_half8(w[s] + b + 2 + 8 * h, d, minus8d, lo, hi);
#pragma GCC unroll 3
        for (int t = 0; t < T; ++t) {
          acc[s][h % U][t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x[t] + k + 8 * h), acc[s][h % U][t]);
          acc[s][(h + 2) % U][t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x[t] + k + 16 + 8 * h), acc[s][(h + 2) % U][t]);
        }
      }
    }
  }
  q4_finish<F, S, U, T>(acc, o);
}

// AVX-512: a block as two 16-lane vectors (values 0-15, 16-31); a 16-lane accumulator is two of the
// AVX2 kernel's side by side (lanes 0-7 its accumulator 2z, lanes 8-15 its 2z + 1), as cpu_common.h's
// dot_streams_avx512, so the sums are the AVX2 kernel's bit for bit.
template <RowSum F, int S, int T>
MOEBENCH_Q4_AVX512_TARGET void q4_dot_streams_avx512(const Q4* const* w, const float* const* x, int64_t K, float* o) {
  constexpr int U = F == RowSum::kDense ? 2 : (T == 1 ? 4 : 2);
  constexpr int Z = U / 2;
  __m512 wide[S][Z][T];
  for (int s = 0; s < S; ++s)
    for (int z = 0; z < Z; ++z)
      for (int t = 0; t < T; ++t) wide[s][z][t] = _mm512_setzero_ps();
  for (int64_t k = 0, b = 0; k < K; k += kQ4Values, b += kQ4Bytes) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const __m512 d = _mm512_set1_ps(q4_scale(w[s] + b)), minus8d = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
      const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[s] + b + 2)));
      const __m512 v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(n, _mm512_set1_epi32(0x0F))), d, minus8d);
      const __m512 v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(n, 4)), d, minus8d);
#pragma GCC unroll 3
      for (int t = 0; t < T; ++t) {
        wide[s][0][t] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x[t] + k), wide[s][0][t]);
        wide[s][Z - 1][t] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x[t] + k + 16), wide[s][Z - 1][t]);
      }
    }
  }
  __m256 acc[S][U][T];
  for (int s = 0; s < S; ++s)
    for (int z = 0; z < Z; ++z)
      for (int t = 0; t < T; ++t) {
        acc[s][2 * z][t] = _mm512_castps512_ps256(wide[s][z][t]);
        acc[s][2 * z + 1][t] = _mm512_extractf32x8_ps(wide[s][z][t], 1);
      }
  q4_finish<F, S, U, T>(acc, o);
}

// What dot_rows_streamed (cpu_common.h) calls for Q4 rows; K a multiple of 32.
template <RowSum F, int S, int T>
inline void dot_streams(const Q4* const* w, const float* const* x, int64_t K, float* o) {
  if (avx512_streams()) q4_dot_streams_avx512<F, S, T>(w, x, K, o);
  else q4_dot_streams_avx2<F, S, T>(w, x, K, o);
}

// ---- the MoE kernel's tiles (moe_cpu.cpp: dot_tile), for Q4 rows ---------------------------------
//
// out[r * T + t] = dot(row r, token t), one accumulator per (row, token) taking the 8-value groups in
// order, as the float32 tile does. pf: the byte offset of the rows the next group reads, prefetched
// block by block.
template <int R, int T>
MOEBENCH_Q4_TARGET void dot_tile(const Q4* const* w, const float* const* x, int64_t K, float* out, int64_t pf = 0) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0, b = 0; k < K; k += kQ4Values, b += kQ4Bytes) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (pf != 0) _mm_prefetch(reinterpret_cast<const char*>(w[r] + pf + b), _MM_HINT_T1);
      __m256 v[4];
      q4_block8(w[r] + b, v);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x[t] + k + 8 * j), acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r * T + t] = hsum(acc[r][t]);
}

}  // namespace moebench_cpu
