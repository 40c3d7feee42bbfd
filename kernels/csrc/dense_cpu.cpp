// Dense projections (x @ w.T) for few tokens, on the CPU, on the step's thread pool (pool.h).
//
// Dense projections. At decode time x has 1-16 rows and w a few MB: a weight row is read once and
// meets every token while it is in L1. Items are blocks of output rows; with up to 3 tokens the
// block's rows are read as four runs side by side (four sequential streams, which one core reads
// faster than one: dot_rows_streamed in cpu_common.h), with more, 4 rows x 3 tokens at a time (12
// accumulators, each loaded weight vector feeds 3 FMAs; up to 6 tokens with AVX-512's registers)
// over chunks of K that stay in L1. torch's matmul on these shapes (MKL) reaches a fraction of the
// read bandwidth and uses the second thread poorly.

#include "ops.h"

#include <fcntl.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <mutex>
#include <thread>
#include <vector>

namespace moebench_cpu {

std::atomic<int64_t> g_streamed_rows[2];
std::atomic<int64_t> g_tiled_rows[2];
std::atomic<int64_t> g_run_bytes{128 * 1024};
std::atomic<int64_t> g_q8_weight_rows{0};
std::atomic<int64_t> g_q8_activation_rows{0};
std::atomic<bool> g_q8_activations{false};

bool q8_activations() { return g_q8_activations.load(std::memory_order_relaxed); }

bool avx512_streams() {
  static const bool on = [] {
    if (!avx512_allowed()) return false;  // the avx512 override (pool.cpp: set_overrides)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return on;
}

}  // namespace moebench_cpu

namespace {

using moebench_cpu::hsum;
using moebench_cpu::load1;
using moebench_cpu::load8;
using moebench_cpu::dot_rows_streamed;
using moebench_cpu::parallel_for;

// 4+ tokens. Each (row, token) has one 8-lane accumulator over k (lane j takes k = j mod 8, in
// increasing k), summed across lanes at the end, then the K % 8 tail; rows are taken 4 at a time
// and tokens in groups (tile_groups: up to 3 with AVX2, up to 6 with AVX-512). With the whole of K
// in one pass, the 4 rows and the token groups (28 KB at K = 1024 for one group, more for the next)
// did not stay in L1 and the FMAs waited on L2 (docs/cpu-decode.md, "Batch 16: the dense
// projections in L1"); so K is taken in chunks, 4 rows' and up to 16 tokens' chunks (20 KB) staying
// in L1 while every token group passes over them, the accumulators kept in memory between chunks.
// Below 8 tokens the FMAs do not wait on L2 and K is one chunk. Neither chunks nor groups change which products an accumulator adds,
// or in what order: the sums are those of one pass.
//
// The tokens are read from a packed copy (PackedTokens): rows of x a multiple of 4 KB apart (K =
// 1024 float32) put every token's chunk in the same few L1 sets, with the weight rows (also 4 KB
// apart), and the 20 lines a k-step's groups touch there did not fit the 8 ways: with every operand
// in cache the tile ran far below the core's FMA peak, and packed it runs closer to it
// (docs/cpu-decode.md, "The tokens packed").
constexpr int64_t kStreamedTokens = 3;   // up to this many tokens: rows read as streams, x as it is
constexpr int64_t kChunk = 256;          // K values per chunk
constexpr int64_t kChunkFromTokens = 8;  // fewer tokens: K in one chunk
constexpr int64_t kSlab = 16;            // tokens per pass over a row group's chunks

// x's first K - K % 8 columns as [slab][k / 8][token in slab][8]: a k-step's 8 values of a slab's
// tokens are 512 contiguous bytes, so the tokens' chunks fill consecutive L1 sets.
class PackedTokens {
 public:
  PackedTokens(const float* x, int64_t ldx, int64_t N, int64_t K)
      : steps_(K / 8), data_(static_cast<float*>(std::aligned_alloc(32, bytes(N, K)))) {
    TORCH_CHECK(data_ != nullptr, "dense_linear: out of memory packing the tokens");
    for (int64_t t = 0; t < N; ++t)
      for (int64_t j = 0; j < steps_; ++j)
        _mm256_store_ps(vector(t / kSlab, j, t % kSlab), _mm256_loadu_ps(x + t * ldx + 8 * j));
  }
  ~PackedTokens() { std::free(data_); }
  PackedTokens(const PackedTokens&) = delete;
  PackedTokens& operator=(const PackedTokens&) = delete;

  // token t's (within slab s) 8 values of k-step j; the next k-step's are kStepFloats further on
  float* vector(int64_t s, int64_t j, int64_t t) const { return data_ + ((s * steps_ + j) * kSlab + t) * 8; }
  static constexpr int64_t kStepFloats = kSlab * 8;

 private:
  static size_t bytes(int64_t N, int64_t K) {
    const int64_t slabs = (N + kSlab - 1) / kSlab;
    return static_cast<size_t>(std::max<int64_t>(8, slabs * (K / 8) * kStepFloats)) * sizeof(float);
  }
  int64_t steps_;
  float* data_;
};

// acc[r * lda + t] += w row r (rows ldw apart) times token t over [k0, k1), a multiple of 8 long;
// x = token 0's vector of k-step k0 / 8 in PackedTokens.
template <int T, typename W>
__attribute__((always_inline)) inline void tile_chunk(const W* w, int64_t ldw, const float* x, int64_t k0, int64_t k1,
                                                      __m256* acc, int64_t lda) {
  __m256 a[4][T];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 6
    for (int t = 0; t < T; ++t) a[r][t] = acc[r * lda + t];
  for (int64_t k = k0; k < k1; k += 8, x += PackedTokens::kStepFloats) {
    __m256 xv[T];
#pragma GCC unroll 6
    for (int t = 0; t < T; ++t) xv[t] = _mm256_load_ps(x + 8 * t);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m256 wv = load8(w + r * ldw + k);
#pragma GCC unroll 6
      for (int t = 0; t < T; ++t) a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 6
    for (int t = 0; t < T; ++t) acc[r * lda + t] = a[r][t];
}

// One chunk of a row group for the slab's n tokens, in token groups. AVX2 has 16 vector registers:
// groups of 3 tokens (12 accumulators), and 2 pairs instead of a 3 and a 1 (a single token's 4
// accumulators would wait on the FMA latency).
template <typename W>
void tile_groups_avx2(const W* w, int64_t ldw, const float* x, int64_t n, int64_t k0, int64_t k1, __m256* acc) {
  const int64_t threes = n % 3 == 1 && n >= 4 ? n - 4 : n - n % 3;
  int64_t t = 0;
  for (; t < threes; t += 3) tile_chunk<3>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab);
  for (; t + 2 <= n; t += 2) tile_chunk<2>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab);
  if (t < n) tile_chunk<1>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab);
}

// Where the CPU has AVX-512, the same ymm instructions (AVX-512VL) with its 32 registers: groups of
// up to 6 tokens (24 accumulators), as even as n allows, so a chunk of the 4 rows passes the FMAs
// half as many times and 4-6 tokens take one pass. Every accumulator takes the same FMAs in the same
// order as in the AVX2 groups: the sums are theirs bit for bit.
template <typename W>
MOEBENCH_AVX512_TARGET void tile_groups_avx512(const W* w, int64_t ldw, const float* x, int64_t n,
                                               int64_t k0, int64_t k1, __m256* acc) {
  const int64_t groups = (n + 5) / 6;
  for (int64_t g = 0, t = 0; g < groups; ++g) {
    const int64_t size = n / groups + (g < n % groups ? 1 : 0);
    switch (size) {
      case 6: tile_chunk<6>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab); break;
      case 5: tile_chunk<5>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab); break;
      case 4: tile_chunk<4>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab); break;
      case 3: tile_chunk<3>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab); break;
      case 2: tile_chunk<2>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab); break;
      default: tile_chunk<1>(w, ldw, x + 8 * t, k0, k1, acc + t, kSlab); break;
    }
    t += size;
  }
}

template <typename W>
inline void tile_groups(const W* w, int64_t ldw, const float* x, int64_t n, int64_t k0, int64_t k1, __m256* acc) {
  if (moebench_cpu::avx512_streams()) tile_groups_avx512(w, ldw, x, n, k0, k1, acc);
  else tile_groups_avx2(w, ldw, x, n, k0, k1, acc);
}

// Rows per work item: with 4+ tokens always, with 1-3 the fewest (streamed_item_rows, cpu_common.h,
// sizes those items in bytes, up to kMaxStreamedItemRows).
constexpr int64_t kRowsPerItem = 64;  // 256 KB of float32 weights at K = 1024
constexpr int64_t kMaxStreamedItemRows = 1024;

// A row's sum times its scale (row-scaled int8 / fp8 weights; none for float weights), plus its bias.
// Row r's scale is scale[r * ss]: ss is 1 for a separate scale vector (an LM head), the row stride in
// floats for int8 rows that carry their scale (--weights int8).
inline float finish_row(float sum, const float* scale, int64_t ss, const float* bias, int64_t r) {
  if (scale != nullptr) sum *= scale[r * ss];
  return bias != nullptr ? sum + bias[r] : sum;
}

// out[t, r] = dot(x[t], w[r]) (* scale[r]) (+ bias[r]) for rows [r0, r1) and all N tokens.
template <typename W>
void dense_rows(const float* x, int64_t ldx, const PackedTokens* packed, int64_t N, const W* w, int64_t ldw,
                const float* bias, const float* scale, int64_t ss, int64_t K, float* out, int64_t ldo, int64_t r0,
                int64_t r1) {
  if (N <= kStreamedTokens) {  // the rows as four streams side by side, each row with every token (cpu_common.h)
    float rows_out[kMaxStreamedItemRows * 3];
    const float* xs[3] = {x, x + ldx, x + 2 * ldx};
    dot_rows_streamed<moebench_cpu::RowSum::kDense, W>([&](int64_t i) { return w + (r0 + i) * ldw; }, r1 - r0, N, xs,
                                                       K, rows_out);
    for (int64_t i = 0; i < r1 - r0; ++i)
      for (int64_t t = 0; t < N; ++t)
        out[t * ldo + r0 + i] = scale != nullptr ? finish_row(rows_out[i * N + t], scale, ss, bias, r0 + i)
                                                 : rows_out[i * N + t] + (bias != nullptr ? bias[r0 + i] : 0.0f);
    return;
  }
  // 4 rows at a time, taken from four runs of the block read side by side (rows i, i + q, i + 2q,
  // i + 3q) as with fewer tokens, in chunks of K (see kChunk)
  // int8 / fp8 / int4 rows: each chunk of the 4 rows is widened once into `wide` (4 KB, in L1) and
  // every token group reads it there; widened in each group's FMA loop instead, it cost more than the
  // multiplies. Chunks do not change the sums (above), so K is always taken in chunks here.
  constexpr bool kQ4 = std::is_same_v<W, moebench_cpu::Q4>;  // int4 rows: whole blocks (K % 32 == 0)
  constexpr bool kWiden = std::is_same_v<W, int8_t> || std::is_same_v<W, c10::Float8_e4m3fn> || kQ4;
  const int64_t q = (r1 - r0) / 4, K8 = K - K % 8;
  const int64_t chunk = kWiden || N >= kChunkFromTokens ? kChunk : std::max<int64_t>(K8, 8);
  moebench_cpu::count_tiled_rows(4 * q);
  alignas(32) __m256 acc[4 * kSlab];
  alignas(32) float wide[kWiden ? 4 * kChunk : 8];
  for (int64_t i = 0; i < q; ++i) {
    const W* rows = w + (r0 + i) * ldw;
    for (int64_t s0 = 0; s0 < N; s0 += kSlab) {
      const int64_t n = std::min(kSlab, N - s0);
      const float* xs = x + s0 * ldx;
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t k0 = 0; k0 < K8; k0 += chunk) {
        const int64_t k1 = std::min(K8, k0 + chunk);
        const float* xk = packed->vector(s0 / kSlab, k0 / 8, 0);
        if constexpr (kWiden) {
          for (int g = 0; g < 4; ++g)
            if constexpr (kQ4) moebench_cpu::q4_widen(rows + g * q * ldw, k0, k1, wide + g * kChunk);
            else
              for (int64_t k = k0; k < k1; k += 8) _mm256_store_ps(wide + g * kChunk + k - k0, load8(rows + g * q * ldw + k));
          tile_groups(static_cast<const float*>(wide), kChunk, xk, n, 0, k1 - k0, acc);
        } else {
          tile_groups(rows, q * ldw, xk, n, k0, k1, acc);
        }
      }
      for (int g = 0; g < 4; ++g) {
        const W* row = rows + g * q * ldw;
        const int64_t r = r0 + i + g * q;
        for (int64_t t = 0; t < n; ++t) {
          float sum = hsum(acc[g * kSlab + t]);
          if constexpr (!kQ4)
            for (int64_t kk = K8; kk < K; ++kk) sum += load1(row + kk) * xs[t * ldx + kk];
          out[(s0 + t) * ldo + r] = scale != nullptr ? finish_row(sum, scale, ss, bias, r)
                                                     : sum + (bias != nullptr ? bias[r] : 0.0f);
        }
      }
    }
  }
  for (int64_t r = r0 + 4 * q; r < r1; ++r) {  // the rows left over: one at a time, token by token
    const W* row = w + r * ldw;
    for (int64_t t = 0; t < N; ++t) {
      const float* token = x + t * ldx;
      float dot;
      moebench_cpu::dot_streams<moebench_cpu::RowSum::kDense, 1, 1>(&row, &token, K, &dot);
      out[t * ldo + r] = scale != nullptr ? finish_row(dot, scale, ss, bias, r) : dot + (bias != nullptr ? bias[r] : 0.0f);
    }
  }
}

// int4 rows, or int8 rows with their row scales, with q8 activations (q8_cpu.h): the N tokens quantized
// once, then every item's rows with every token. Items are sized as the weight-only kernel's
// (streamed_item_rows) for any N: the rows are read as eight runs and meet 3 tokens at a time while
// they are in L1. scale / ss as finish_row's (nullptr for int4 rows, whose scales are in their blocks).
template <typename W>
void dense_q8(const float* x, int64_t ldx, int64_t N, int64_t K, const W* w, int64_t ldw, int64_t M,
              const float* bias, const float* scale, int64_t ss, float* out, int threads) {
  thread_local moebench_cpu::Q8Tokens tokens;  // the caller's thread quantizes; the pool's threads only read
  tokens.resize(N, K);
  std::vector<int64_t> order(static_cast<size_t>(N));
  for (int64_t t = 0; t < N; ++t) {
    tokens.quantize(t, x + t * ldx);
    order[t] = t;
  }
  moebench_cpu::g_q8_activation_rows.fetch_add(N, std::memory_order_relaxed);
  const int64_t rows_per_item = moebench_cpu::streamed_item_rows(
      ldw * static_cast<int64_t>(sizeof(W)), kRowsPerItem, kMaxStreamedItemRows, threads,
      [M](int64_t r) { return (M + r - 1) / r; });
  const int64_t items = (M + rows_per_item - 1) / rows_per_item;
  const moebench_cpu::Q8Tokens& q8 = tokens;
  parallel_for(items, threads, [&](int64_t i) {
    const int64_t r0 = i * rows_per_item, r1 = std::min(M, r0 + rows_per_item);
    thread_local std::vector<float> o;
    o.resize(static_cast<size_t>((r1 - r0) * N));
    moebench_cpu::q8_dot_rows([&](int64_t r) { return w + (r0 + r) * ldw; }, r1 - r0, q8, order.data(), N, o.data());
    // token by token: writing the N tokens' rows side by side, M floats apart, would put them all in one
    // L1 set where M * 4 is a multiple of 4 KiB
    for (int64_t t = 0; t < N; ++t)
      for (int64_t r = 0; r < r1 - r0; ++r) out[t * M + r0 + r] = finish_row(o[r * N + t], scale, ss, bias, r0 + r);
  });
}

}  // namespace

// x [N, K] float32 (rows contiguous), w [M, K] float32 or bfloat16 (rows contiguous), bias [M] or
// None -> [N, M] float32. Items are blocks of output rows (64; with 1-3 tokens sized in bytes,
// streamed_item_rows), run on the step's thread pool.
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "dense_linear: x must be float32 [N, K] with contiguous rows");
  const int64_t N = x.size(0), K = x.size(1), M = w.size(0);
  TORCH_CHECK(w.dim() == 2 && moebench_cpu::takes_rows(w, K, moebench_cpu::kDenseWeights),
              "dense_linear: w must be [M, ", K, " (+ a format's row bytes)] with contiguous rows in one of: ",
              moebench_cpu::accepted_formats(moebench_cpu::kDenseWeights), "; got ", w.scalar_type(), " ", w.sizes());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == M, "dense_linear: bias has ", b.numel(), " values for ", M, " rows");
  }
  auto out = torch::empty({N, M}, x.options());
  pybind11::gil_scoped_release no_gil;
  dense_linear_into(x.data_ptr<float>(), x.stride(0), N, K, w, b.defined() ? b.data_ptr<float>() : nullptr,
                    out.data_ptr<float>());
  return out;
}

void dense_linear_into(const float* xp, int64_t ldx, int64_t N, int64_t K, const torch::Tensor& w, const float* bp,
                       float* op, const float* sp, bool count) {
  const int64_t M = w.size(0), ldw = w.stride(0);
  if (N == 0 || M == 0) return;
  // 64 rows' worth of weights is microseconds of work: below a few of them a second thread costs
  // more to hand the work to than it saves
  const int threads = (M + kRowsPerItem - 1) / kRowsPerItem >= 4 ? moebench_cpu::step_threads() : 1;
  const int64_t rows_per_item =
      N <= kStreamedTokens ? moebench_cpu::streamed_item_rows(ldw * w.element_size(), kRowsPerItem, kMaxStreamedItemRows,
                                                              threads, [M](int64_t r) { return (M + r - 1) / r; })
                           : kRowsPerItem;
  const int64_t items = (M + rows_per_item - 1) / rows_per_item;
  std::unique_ptr<PackedTokens> packed;
  if (N > kStreamedTokens) packed = std::make_unique<PackedTokens>(xp, ldx, N, K);
  auto run = [&](const auto* wp, const float* scale, int64_t ss = 1) {
    parallel_for(items, threads, [&](int64_t i) {
      dense_rows(xp, ldx, packed.get(), N, wp, ldw, bp, scale, ss, K, op, M, i * rows_per_item,
                 std::min(M, (i + 1) * rows_per_item));
    });
  };
  if (count) count_weights(0, w.scalar_type(), M * ldw * w.element_size());
  switch (w.scalar_type()) {
    case torch::kFloat32: run(w.data_ptr<float>(), nullptr); break;
    case torch::kBFloat16: run(w.data_ptr<at::BFloat16>(), nullptr); break;
    case torch::kChar: {
      const float* scale = sp;
      int64_t ss = 1;
      if (sp == nullptr) {  // rows that carry their scale: row r's is the float after its K values
        TORCH_CHECK(packed_int8(w, K), "dense_linear_into: int8 weights need a row scale or rows of K + ",
                    moebench_cpu::kPackedExtra, " bytes");
        scale = reinterpret_cast<const float*>(w.data_ptr<int8_t>() + K);
        ss = ldw / 4;
      }
      if (moebench_cpu::q8_activations()) {
        if (K % moebench_cpu::kQ4Values == 0) {
          dense_q8(xp, ldx, N, K, w.data_ptr<int8_t>(), ldw, M, bp, scale, ss, op, threads);
          break;
        }
        TORCH_WARN_ONCE("moebench: q8 ACTIVATIONS NOT APPLIED: int8 rows of ", K, " values (not whole blocks of ",
                        moebench_cpu::kQ4Values, ") meet float32 activations");
      }
      run(w.data_ptr<int8_t>(), scale, ss);
      break;
    }
    case torch::kFloat8_e4m3fn: run(w.data_ptr<c10::Float8_e4m3fn>(), sp); break;
    case torch::kByte:  // int4 rows, Q4_0 blocks (int4_cpu.h): the scales are in the blocks
      TORCH_CHECK(K % moebench_cpu::kQ4Values == 0 && w.size(1) == moebench_cpu::q4_row_bytes(K),
                  "dense_linear_into: int4 rows must be whole Q4_0 blocks, ", moebench_cpu::q4_row_bytes(K), " bytes");
      if (moebench_cpu::q8_activations()) {
        dense_q8(xp, ldx, N, K, reinterpret_cast<const moebench_cpu::Q4*>(w.data_ptr<uint8_t>()), ldw, M, bp, nullptr, 1,
                 op, threads);
        break;
      }
      run(reinterpret_cast<const moebench_cpu::Q4*>(w.data_ptr<uint8_t>()), nullptr);
      break;
    default: TORCH_CHECK(false, "dense_linear_into: unsupported weight dtype ", w.scalar_type());
  }
}

namespace {

// LM-head projections that ran in the kernel, by weight dtype: calls and bytes streamed (weights
// and row scales). Read by lm_head_stats; the engine reports the difference over a run.
constexpr int kHeadDtypes = moebench_cpu::kNumCountedDtypes;  // weight_format.h's counted dtypes
std::atomic<int64_t> g_head_calls[kHeadDtypes];
std::atomic<int64_t> g_head_bytes[kHeadDtypes];

int head_dtype_index(torch::ScalarType t) { return moebench_cpu::counted_dtype_index(t); }

}  // namespace

void count_lm_head(const torch::Tensor& w, bool scaled) {
  const int i = head_dtype_index(w.scalar_type());
  if (i < 0) return;
  g_head_calls[i].fetch_add(1, std::memory_order_relaxed);
  g_head_bytes[i].fetch_add(w.numel() * w.element_size() + (scaled ? w.size(0) * 4 : 0), std::memory_order_relaxed);
}

namespace {
// Weights the kernels streamed, by kind (dense projections, routed experts) and dtype: bytes and calls.
constexpr const char* kWeightKinds[2] = {"dense", "experts"};
std::atomic<int64_t> g_weight_calls[2][kHeadDtypes];
std::atomic<int64_t> g_weight_bytes[2][kHeadDtypes];
}  // namespace

void count_weights(int which, torch::ScalarType dtype, int64_t bytes) {
  const int i = head_dtype_index(dtype);
  if (i < 0) return;
  g_weight_calls[which][i].fetch_add(1, std::memory_order_relaxed);
  g_weight_bytes[which][i].fetch_add(bytes, std::memory_order_relaxed);
}

// The checks of an LM head's weight and scale (dense_linear's, widened to int8 / fp8 with a scale).
void check_lm_head(const torch::Tensor& w, const c10::optional<torch::Tensor>& scale, int64_t K, const char* who) {
  const moebench_cpu::WeightFormat* format = moebench_cpu::weight_format(w.scalar_type(), moebench_cpu::kLmHeadWeights);
  TORCH_CHECK(w.dim() == 2 && moebench_cpu::takes_rows(w, K, moebench_cpu::kLmHeadWeights), who,
              ": the LM head must be [vocab, ", K, "] with contiguous rows in one of: ",
              moebench_cpu::accepted_formats(moebench_cpu::kLmHeadWeights));
  const bool quantized = format->scale_tensor;
  const bool has_scale = scale.has_value() && scale->defined();
  TORCH_CHECK(has_scale == quantized, who, ": an int8 or fp8 LM head takes a row scale, a float one none");
  if (has_scale)
    TORCH_CHECK(scale->dim() == 1 && scale->numel() == w.size(0) && scale->scalar_type() == torch::kFloat32 &&
                    scale->is_contiguous(),
                who, ": the row scale must be contiguous float32 [", w.size(0), "]");
}

namespace {

// x [N, K] float32 @ the LM head's rows (float32, bfloat16, or int8 / fp8 times their row scale) ->
// [N, vocab] float32, counted in lm_head_stats.
torch::Tensor lm_head_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "lm_head_linear: x must be float32 [N, K] with contiguous rows");
  check_lm_head(w, scale, x.size(1), "lm_head_linear");
  const bool scaled = scale.has_value() && scale->defined();
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  pybind11::gil_scoped_release no_gil;
  dense_linear_into(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), w, nullptr, out.data_ptr<float>(),
                    scaled ? scale->data_ptr<float>() : nullptr, /*count=*/false);
  count_lm_head(w, scaled);
  return out;
}

pybind11::dict weight_stats() {
  pybind11::dict d;
  for (int k = 0; k < 2; ++k) {
    pybind11::dict kind;
    for (int i = 0; i < kHeadDtypes; ++i) {
      const int64_t calls = g_weight_calls[k][i].load(std::memory_order_relaxed);
      if (calls == 0) continue;
      pybind11::dict one;
      one["calls"] = calls;
      one["bytes"] = g_weight_bytes[k][i].load(std::memory_order_relaxed);
      kind[moebench_cpu::counted_dtype_name(i)] = one;
    }
    d[kWeightKinds[k]] = kind;
  }
  return d;
}

pybind11::dict lm_head_stats() {
  pybind11::dict d;
  for (int i = 0; i < kHeadDtypes; ++i) {
    pybind11::dict one;
    one["calls"] = g_head_calls[i].load(std::memory_order_relaxed);
    one["bytes"] = g_head_bytes[i].load(std::memory_order_relaxed);
    d[moebench_cpu::counted_dtype_name(i)] = one;
  }
  return d;
}

}  // namespace

namespace {

// Reads x (contiguous float32, 1-D) once on the step's thread pool, each 1 MB item as four runs
// side by side, the way the decode kernels read weights (dot_rows_streamed); returns the sum of
// the values, so that the reads are not optimized away. `moebench.machine` times it as one of its
// bandwidth probes: on one core it reads faster than a single stream such as torch's `sum`.
double read_in_runs(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "read_in_runs: x must be a contiguous 1-D float32 tensor");
  constexpr int64_t kItem = 1 << 18, kRun = kItem / 4;  // floats
  const float* xp = x.data_ptr<float>();
  const int64_t items = x.numel() / kItem;
  std::vector<float> partial(static_cast<size_t>(items));
  {
    pybind11::gil_scoped_release no_gil;
    parallel_for(items, moebench_cpu::step_threads(), [&](int64_t i) {
      const float* p = xp + i * kItem;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < kRun; k += 8) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + k));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + kRun + k));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + 2 * kRun + k));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + 3 * kRun + k));
      }
      partial[i] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    });
  }
  double sum = 0;
  for (float v : partial) sum += v;
  for (int64_t k = items * kItem; k < x.numel(); ++k) sum += xp[k];
  return sum;
}

// The rows the streamed dots read with each kernel (cpu_common.h: dot_rows_streamed), the rows the
// tiles of 4+ tokens read with each (dense_cpu.cpp tile_groups, moe_cpu.cpp rows8_tokens), and which
// one this process runs: the activation evidence of the AVX-512 kernels.
pybind11::dict simd_stats() {
  pybind11::dict d;
  d["streams"] = moebench_cpu::avx512_streams() ? "avx512" : "avx2";
  d["avx2_rows"] = moebench_cpu::g_streamed_rows[0].load(std::memory_order_relaxed);
  d["avx512_rows"] = moebench_cpu::g_streamed_rows[1].load(std::memory_order_relaxed);
  d["avx2_tiled_rows"] = moebench_cpu::g_tiled_rows[0].load(std::memory_order_relaxed);
  d["avx512_tiled_rows"] = moebench_cpu::g_tiled_rows[1].load(std::memory_order_relaxed);
  // the activations override (q8_cpu.h): int4 rows dotted with q8 tokens, token rows quantized
  d["activations"] = moebench_cpu::q8_activations() ? "q8" : "f32";
  d["q8_weight_rows"] = moebench_cpu::g_q8_weight_rows.load(std::memory_order_relaxed);
  d["q8_activation_rows"] = moebench_cpu::g_q8_activation_rows.load(std::memory_order_relaxed);
  return d;
}

}  // namespace

// weight_format.h's table, for the Python side (kernels/cpu_moe.py weight_formats).
static pybind11::list weight_formats() {
  pybind11::list out;
  for (const moebench_cpu::WeightFormat& f : moebench_cpu::kWeightFormats) {
    pybind11::list uses;
    if (f.uses & moebench_cpu::kDenseWeights) uses.append("dense");
    if (f.uses & moebench_cpu::kExpertWeights) uses.append("experts");
    if (f.uses & moebench_cpu::kLmHeadWeights) uses.append("lm_head");
    pybind11::dict d;
    d["dtype"] = f.name;
    d["torch_dtype"] = f.torch_dtype != nullptr ? f.torch_dtype : f.name;
    d["block_values"] = f.block_values;
    d["block_bytes"] = f.block_bytes;
    d["layout"] = f.layout;
    d["row_extra"] = f.row_extra;
    d["scale_tensor"] = f.scale_tensor;
    d["uses"] = uses;
    out.append(d);
  }
  return out;
}

void register_dense(pybind11::module& m) {
  m.def("weight_formats", &weight_formats, "The weight formats the kernels stream: dtype, row layout, extra bytes "
        "per row, whether a row-scale tensor comes with it, and which kernels take it (dense, experts, lm_head)");
  m.def("dense_linear", &dense_linear, "x @ w.T (+ bias) for few rows of x, on the step's thread pool (float32)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("lm_head_linear", &lm_head_linear,
        "x @ w.T for an LM head of float32, bfloat16, or int8 / fp8 e4m3 weights with a float32 scale per row "
        "(float32 accumulation), on the step's thread pool; counted in lm_head_stats",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale") = pybind11::none());
  m.def("weight_stats", &weight_stats,
        "Weights streamed by the kernels so far, {dense, experts} -> weight dtype -> calls and bytes (rows and "
        "scales; the LM head is in lm_head_stats)");
  m.def("lm_head_stats", &lm_head_stats, "LM-head projections run in the kernel so far, by weight dtype: calls and bytes streamed");
  m.def("read_in_runs", &read_in_runs, "Read a float32 buffer once as the decode kernels read weights (a bandwidth probe)");
  m.def("set_stream_run_bytes", [](int64_t bytes) {
    TORCH_CHECK(bytes >= 0, "set_stream_run_bytes: bytes must be >= 0");
    moebench_cpu::g_run_bytes.store(bytes, std::memory_order_relaxed);
  }, "The length a run of streamed rows aims at (cpu_common.h: streamed_item_rows); 0: a fixed row count per item");
  m.def("stream_run_bytes", [] { return moebench_cpu::g_run_bytes.load(std::memory_order_relaxed); },
        "The length a run of streamed rows aims at now, in bytes");
  m.def("set_activations", [](const std::string& activations) {
    TORCH_CHECK(activations == "f32" || activations == "q8", "set_activations: f32 or q8, not ", activations);
    moebench_cpu::g_q8_activations.store(activations == "q8", std::memory_order_relaxed);
  }, "What int4 weights meet in the dense and fused MoE kernels: f32 activations (exact) or q8, activations "
     "quantized per block of 32 to int8 with a float32 scale and integer dot products (approximate)",
        pybind11::arg("activations"));
  m.def("activations", [] { return std::string(moebench_cpu::q8_activations() ? "q8" : "f32"); },
        "The activations int4 weights meet now (set_activations)");
  m.def("simd_stats", &simd_stats, "The streamed dots' and tiles' kernel in this process (avx512 or avx2) and the rows each one read so far");
}
