// What the CPU kernels of the moebench_moe_cpu extension share: the AVX2 loads that widen bfloat16
// weights in registers, and the decode-time dot products, with an AVX-512 twin chosen at run time
// where the CPU has it. The step's thread pool is pool.h's; the ops' declarations are ops.h's.
#pragma once

#include <torch/extension.h>

#include "pool.h"
#include "weight_format.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace moebench_cpu {


// ---- loads: 8 weights as float32 -------------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen the 16-bit lanes to 32 bits and shift.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }

// int8 weights (an LM head quantized per output row: the caller multiplies each row's sum by its
// scale): sign-extend 8 bytes to 32-bit lanes and convert.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float load1(const int8_t* p) { return static_cast<float>(*p); }

// ---- int8 rows that carry their scale (--weights int8) ------------------------------------
// A matrix quantized per output row (engine/quantize.py: pack_int8_rows) is one int8 tensor whose
// rows are K + kPackedExtra bytes: the row's K values, its float32 scale, 4 bytes of padding. An
// expert store then moves an expert's scales with its rows, as one tensor (kernels/reference.py:
// unpack_int8_rows reads the same layout). A row's dot product with the stored values is
// multiplied by its scale at the end; float32 and bfloat16 rows have none (1: the same sum).
inline float packed_scale(const int8_t* row, int64_t K) {
  float s;
  std::memcpy(&s, row + K, sizeof(float));
  return s;
}
template <typename W>
inline float row_scale(const W* row, int64_t K) {
  if constexpr (std::is_same_v<W, int8_t>) return packed_scale(row, K);
  else return 1.0f;
}

// fp8 e4m3fn weights (also row-scaled), widened in registers: this CPU has no fp8 arithmetic. The
// byte's 7 exponent and mantissa bits are moved to the top of a float32's exponent and mantissa
// fields and the sign to bit 31 (sign-extended, shifted by 20, masked), which reads as the same
// value times 2^-120 (float32's exponent bias is 127, e4m3's 7); one multiply restores it. A
// subnormal e4m3 value lands on a float32 subnormal and comes out exact too, unless the thread
// treats denormal inputs as zero (DAZ, which torch leaves off). 0x7f / 0xff (e4m3fn's NaN) read
// as 480: quantize_lm_head never writes them.
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m256i s = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(s, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}
inline float load1(const c10::Float8_e4m3fn* p) { return static_cast<float>(*p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


// ---- decode-time dot products: weight rows read as several streams at once ---------------
//
// One core following one sequential stream keeps too few cache misses in flight to reach the
// bandwidth it can get: four streams read side by side (four runs of rows, each tens of KB or more)
// stream faster on one core than one row after another (docs/cpu-decode.md, "Rows read as four
// runs"). Rows a few KB long read side by side do not help (each ends before a prefetcher has
// ramped up), hence runs of consecutive rows.
//
// Each row is summed in one fixed order (RowSum) whatever rows it is read beside, so streaming
// changed no result: kDense as the dense kernel summed a single row before (two accumulators,
// combined before the last 8-wide steps), kMoe as the MoE kernel summed a decode row before (four
// accumulators for one token, two for more, combined at the end).
enum class RowSum { kDense, kMoe };

// The end of a stream dot, the same for both instruction sets: the kDense accumulators combined, the
// last 8-wide steps, the kMoe accumulators combined, the horizontal sum and the scalar tail.
template <RowSum F, int S, int U, int T, typename W>
inline void finish_streams(__m256 (&acc)[S][U][T], const W* const* w, const float* const* x, int64_t k, int64_t K,
                           float* o) {
  if (F == RowSum::kDense)
    for (int s = 0; s < S; ++s)
      for (int t = 0; t < T; ++t) acc[s][0][t] = _mm256_add_ps(acc[s][0][t], acc[s][1][t]);
  for (; k + 8 <= K; k += 8)
    for (int s = 0; s < S; ++s) {
      const __m256 wv = load8(w[s] + k);
      for (int t = 0; t < T; ++t) acc[s][0][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + k), acc[s][0][t]);
    }
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < T; ++t) {
      __m256 v = acc[s][0][t];
      if (F == RowSum::kMoe)
        for (int u = 1; u < U; ++u) v = _mm256_add_ps(v, acc[s][u][t]);
      float sum = hsum(v);
      for (int64_t kk = k; kk < K; ++kk) sum += load1(w[s] + kk) * x[t][kk];
      o[s * T + t] = sum;
    }
}

template <RowSum F, int S, int T, typename W>
inline void dot_streams_avx2(const W* const* w, const float* const* x, int64_t K, float* o) {
  constexpr int U = F == RowSum::kDense ? 2 : (T == 1 ? 4 : 2);
  __m256 acc[S][U][T];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 3
      for (int t = 0; t < T; ++t) acc[s][u][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      __m256 xv[T];
#pragma GCC unroll 3
      for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x[t] + k + 8 * u);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const __m256 wv = load8(w[s] + k + 8 * u);
#pragma GCC unroll 3
        for (int t = 0; t < T; ++t) acc[s][u][t] = _mm256_fmadd_ps(wv, xv[t], acc[s][u][t]);
      }
    }
  }
  finish_streams<F, S, U, T>(acc, w, x, k, K, o);
}

// ---- the same dot products, 16 lanes at a time (AVX-512) --------------------------------------
//
// Where the CPU has AVX-512 the streamed dots run with 512-bit registers: one load and one widening
// for 16 weights instead of two of each, which is what bounds a one-thread stream of bfloat16 or int8
// weights on a machine that reads ~30 GB/s (docs/bf16.md). The results are bit for bit the AVX2
// kernel's: a 16-lane accumulator is two of the AVX2 kernel's 8-lane accumulators side by side (lanes
// 0-7 its accumulator u, lanes 8-15 its accumulator u + 1), every lane takes the same FMAs in the same
// order, and the end (finish_streams) is the AVX2 code on the two halves. MOEBENCH_AVX512=0 keeps the
// AVX2 kernel on such a CPU (an A/B measurement); simd_stats counts the rows each one streamed.
#define MOEBENCH_AVX512_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl")))

MOEBENCH_AVX512_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MOEBENCH_AVX512_TARGET inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
MOEBENCH_AVX512_TARGET inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
MOEBENCH_AVX512_TARGET inline __m512 load16(const c10::Float8_e4m3fn* p) {  // as load8 above
  const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(s, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

template <RowSum F, int S, int T, typename W>
MOEBENCH_AVX512_TARGET void dot_streams_avx512(const W* const* w, const float* const* x, int64_t K, float* o) {
  constexpr int U = F == RowSum::kDense ? 2 : (T == 1 ? 4 : 2);
  constexpr int Z = U / 2;  // 16-lane accumulators per (stream, token)
  __m512 wide[S][Z][T];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 2
    for (int z = 0; z < Z; ++z)
#pragma GCC unroll 3
      for (int t = 0; t < T; ++t) wide[s][z][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
#pragma GCC unroll 2
    for (int z = 0; z < Z; ++z) {
      __m512 xv[T];
#pragma GCC unroll 3
      for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_ps(x[t] + k + 16 * z);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const __m512 wv = load16(w[s] + k + 16 * z);
#pragma GCC unroll 3
        for (int t = 0; t < T; ++t) wide[s][z][t] = _mm512_fmadd_ps(wv, xv[t], wide[s][z][t]);
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
  finish_streams<F, S, U, T>(acc, w, x, k, K, o);
}

// Whether the streamed dots, and the tiles of 4+ tokens (dense_cpu.cpp, moe_cpu.cpp), run the AVX-512
// kernel in this process (decided once, dense_cpu.cpp), and the rows each kernel streamed or tiled
// (index 1: AVX-512).
bool avx512_streams();
extern std::atomic<int64_t> g_streamed_rows[2];
extern std::atomic<int64_t> g_tiled_rows[2];
inline void count_tiled_rows(int64_t rows) {
  g_tiled_rows[avx512_streams() ? 1 : 0].fetch_add(rows, std::memory_order_relaxed);
}

template <RowSum F, int S, int T, typename W>
inline void dot_streams(const W* const* w, const float* const* x, int64_t K, float* o) {
  if (avx512_streams()) dot_streams_avx512<F, S, T>(w, x, K, o);
  else dot_streams_avx2<F, S, T>(w, x, K, o);
}

// How many rows a work item of streamed rows takes. An item's rows are read as four runs side by side,
// and a run streams at the memory's pace only once it is long enough for the prefetchers: a fixed row
// count made bfloat16 and int8 runs a half and a quarter of float32's, and slower to read
// (docs/cpu-decode.md, "Runs sized in bytes"). So an item takes the rows that make four runs of
// about g_run_bytes (the nearest power of two, between min_rows and max_rows, both powers of two); then
// half as many, not below min_rows, while items(rows) would leave the threads under two items each.
// Which rows an item holds changes no sum (each row is summed in one fixed order, above).
// g_run_bytes is 128 KB; 0 gives every item min_rows rows, a fixed row count (set_stream_run_bytes:
// benchmarks/run_lengths.py alternates the two in one process).
extern std::atomic<int64_t> g_run_bytes;
template <class Items>
inline int64_t streamed_item_rows(int64_t row_bytes, int64_t min_rows, int64_t max_rows, int threads, Items items) {
  const int64_t run_bytes = g_run_bytes.load(std::memory_order_relaxed);
  if (run_bytes <= 0) return min_rows;
  const int64_t exact = 4 * std::max<int64_t>(1, run_bytes / std::max<int64_t>(1, row_bytes));
  int64_t rows = 1;
  while (rows * 2 <= exact) rows *= 2;
  if (exact - rows > 2 * rows - exact) rows *= 2;
  rows = std::clamp(rows, min_rows, max_rows);
  while (rows > min_rows && items(rows) < 2 * static_cast<int64_t>(threads)) rows /= 2;
  return rows;
}

// o[i * T + t] = dot(row(i), x[t]) for rows i in [0, n) and T (1-3) tokens: the rows are cut into
// S consecutive runs which are read side by side, the i-th row of every run at once.
template <RowSum F, int T, typename W, typename Row>
inline void dot_rows_streamed(Row row, int64_t n, const float* const* x, int64_t K, float* o) {
  // Four runs for 2-3 tokens too, though their accumulators then outgrow the 16 ymm registers: the
  // spills are L1 traffic, and two runs left the memory idle longer than spilling costs
  // (docs/cpu-decode.md, "Four runs for 2-3 tokens too").
  constexpr int S = 4;
  const int64_t q = n / S;
  g_streamed_rows[avx512_streams() ? 1 : 0].fetch_add(n, std::memory_order_relaxed);
  for (int64_t i = 0; i < q; ++i) {
    const W* w[S];
    float os[S * T];
    for (int s = 0; s < S; ++s) w[s] = row(s * q + i);
    dot_streams<F, S, T>(w, x, K, os);
    for (int s = 0; s < S; ++s)
      for (int t = 0; t < T; ++t) o[(s * q + i) * T + t] = os[s * T + t];
  }
  for (int64_t i = S * q; i < n; ++i) {
    const W* w = row(i);
    dot_streams<F, 1, T>(&w, x, K, o + i * T);
  }
}

// The same for n (1-3) tokens chosen at run time.
template <RowSum F, typename W, typename Row>
inline void dot_rows_streamed(Row row, int64_t rows, int64_t tokens, const float* const* x, int64_t K, float* o) {
  if (tokens == 1) dot_rows_streamed<F, 1, W>(row, rows, x, K, o);
  else if (tokens == 2) dot_rows_streamed<F, 2, W>(row, rows, x, K, o);
  else dot_rows_streamed<F, 3, W>(row, rows, x, K, o);
}

}  // namespace moebench_cpu

// int4 rows (Q4_0 blocks): the overloads the templates above pick for them
#include "int4_cpu.h"
// int4 rows with activations quantized per block of 32 (the activations override q8; approximate)
#include "q8_cpu.h"
