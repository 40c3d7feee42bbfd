// CPU fused mixture-of-experts forward: AVX2/FMA micro-kernels on the step's thread pool (dense_cpu.cpp).
//
// Decode-time MoE on a CPU is bound by memory bandwidth: every routed expert's weights are
// read once per step and each row meets only a handful of tokens. torch's skinny matmuls
// stream those weights at well under the machine's read bandwidth, so this file does the
// whole layer in one call with kernels shaped for streaming:
//
//   1. counting sort of the (token, top-k slot) pairs by expert, once;
//   2. gate/up: for each (expert, block of intermediate rows) work item, the gate and up
//      rows are dotted with all of that expert's tokens in one pass, and SiLU(gate) * up is
//      written straight into the intermediate buffer (never materialising gate or up);
//   3. down: for each (expert, block of output rows), the expert's rows are dotted with its
//      tokens' intermediate rows, times the routed weight, into that (token, rank) pair's own
//      output row: one contiguous run of weights per item, and no two items write one row;
//   4. each token's k pair rows are summed in rank order. The result does not depend on the
//      thread count or on which thread ran an item.
//
// Micro-kernels keep several weight rows and several tokens in flight: several accumulators
// hide FMA latency, several row streams keep the hardware prefetchers busy, and a weight row
// loaded into a register is reused across up to three tokens.
//
// Weights may be float32 or bfloat16 (widened to float32 in registers: this is a plain shift,
// and halves the bytes streamed), or int8 rows that carry a float32 scale each (--weights int8,
// cpu_common.h: a quarter of float32's bytes; each row's sum is multiplied by its scale);
// activations and accumulation are float32.
// The weight tensors may be any strided view whose last dimension is contiguous: an expert
// store hands in a pool of slots that changes between calls, so nothing is pre-packed.

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using moebench_cpu::dot_rows_streamed;
using moebench_cpu::hsum;
using moebench_cpu::load1;
using moebench_cpu::load8;
using moebench_cpu::parallel_for;
using moebench_cpu::RowSum;

// A row's dot product times its scale: int8 rows carry one (cpu_common.h); float rows are left as
// they are (not multiplied by 1: no instruction is added to their path).
template <typename W>
inline float scaled(float sum, const W* row, int64_t K) {
  if constexpr (std::is_same_v<W, int8_t>) return sum * moebench_cpu::packed_scale(row, K);
  else return sum;
}

// out[r * T + t] = dot(w[r][0:K], x[t][0:K]) for R weight rows and T tokens.
// R * T accumulators plus T activation registers must fit in the 16 ymm registers.
// pf != 0: while streaming row r, prefetch (into L2) the row `pf` elements further on, i.e. the
// row the next group will read. Rows are a few KB and read 8 at a time, too short for the
// hardware prefetchers to ramp up on each; asked for one group ahead, memory is kept busy
// (docs/kernels.md).
template <int R, int T, typename W>
__attribute__((always_inline)) inline void dot_tile(const W* const* w, const float* const* x, int64_t K, float* out,
                                                    int64_t pf = 0) {
  __m256 acc[R][T];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  auto step = [&](int64_t k) {
    __m256 xv[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x[t] + k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w[r] + k);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  };
  int64_t k = 0;
  if (pf != 0) {
    // 16 elements = one 64-byte line of float32 weights (half of one for bfloat16: the other
    // half is asked for by the next pass, a prefetch of a line already on its way costs nothing)
    for (; k + 16 <= K; k += 16) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + pf + k), _MM_HINT_T1);
      step(k);
      step(k + 8);
    }
  }
#pragma GCC unroll 2
  for (; k + 8 <= K; k += 8) step(k);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += load1(w[r] + kk) * x[t][kk];
      out[r * T + t] = s;
    }
}

// Dots a group of 8 weight rows with n tokens (more than 3: an expert's share of a prefill), tile
// by tile, calling epi(first_token, tile_tokens, o) where o[r * tile_tokens + t] holds row r, token
// t: with AVX2, two passes of 4 rows x 3 tokens, so each loaded weight vector feeds 3 FMAs; the
// rows stay in L1/L2 between passes, so memory still sees each row once (AVX-512: one pass, below).
// pf: see dot_tile (only the first token tile prefetches; later tiles find the rows in cache). An
// expert with up to 3 tokens has its rows read as streams instead (dot_rows_streamed,
// cpu_common.h), in a decode step or not.
template <typename W, typename Epi>
void rows8_tokens_avx2(const W* const* w, const float* const* x, int64_t n, int64_t K, Epi&& epi, int64_t pf) {
  float o[8 * 3];
  int64_t t = 0;
  for (; n - t >= 3; t += 3) {
    dot_tile<4, 3>(w, x + t, K, o, t == 0 ? pf : 0);
    dot_tile<4, 3>(w + 4, x + t, K, o + 12, t == 0 ? pf : 0);
    epi(t, 3, o);
  }
  if (n - t == 2) {
    dot_tile<4, 2>(w, x + t, K, o);
    dot_tile<4, 2>(w + 4, x + t, K, o + 8);
    epi(t, 2, o);
  } else if (n - t == 1) {
    dot_tile<8, 1>(w, x + t, K, o);
    epi(t, 1, o);
  }
}

// Where the CPU has AVX-512, the same ymm instructions (AVX-512VL) with its 32 registers: the 8 rows
// x 3 tokens (24 accumulators) in one pass, so the rows are loaded and widened once per token group
// instead of twice. Every accumulator takes the same FMAs in the same order as in the AVX2 passes:
// the sums are theirs bit for bit.
template <typename W, typename Epi>
MOEBENCH_AVX512_TARGET void rows8_tokens_avx512(const W* const* w, const float* const* x, int64_t n, int64_t K,
                                                Epi&& epi, int64_t pf) {
  float o[8 * 3];
  int64_t t = 0;
  for (; n - t >= 3; t += 3) {
    dot_tile<8, 3>(w, x + t, K, o, t == 0 ? pf : 0);
    epi(t, 3, o);
  }
  if (n - t == 2) {
    dot_tile<8, 2>(w, x + t, K, o);
    epi(t, 2, o);
  } else if (n - t == 1) {
    dot_tile<8, 1>(w, x + t, K, o);
    epi(t, 1, o);
  }
}

template <typename W, typename Epi>
inline void rows8_tokens(const W* const* w, const float* const* x, int64_t n, int64_t K, Epi&& epi, int64_t pf = 0) {
  if (moebench_cpu::avx512_streams()) rows8_tokens_avx512(w, x, n, K, epi, pf);
  else rows8_tokens_avx2(w, x, n, K, epi, pf);
}

// Same for a group of 2 rows (the remainder when a width is not a multiple of the group).
template <typename W, typename Epi>
inline void rows2_tokens(const W* const* w, const float* const* x, int64_t n, int64_t K, Epi&& epi) {
  float o[2 * 4];
  int64_t t = 0;
  for (; n - t >= 4; t += 4) {
    dot_tile<2, 4>(w, x + t, K, o);
    epi(t, 4, o);
  }
  for (; t < n; ++t) {
    dot_tile<2, 1>(w, x + t, K, o);
    epi(t, 1, o);
  }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// Rows per work item: gate/up, a block of intermediate rows (its gate rows and its up rows); down, a
// block of one expert's output rows. Sized in bytes (streamed_item_rows, cpu_common.h): runs of about
// 128 KB when an expert has 1-3 tokens and its item's rows are read as four runs side by side (at the
// 0.89B shapes in bfloat16: 128 intermediate rows, 1024 output rows), while every thread still gets
// two items; never fewer than 32 intermediate rows or 256 output rows.
constexpr int64_t kMinGateUpBlock = 32, kMaxGateUpBlock = 256;
constexpr int64_t kMinDownBlock = 256, kMaxDownBlock = 2048;
constexpr double kMinParallelBytes = 256.0 * 1024;

template <typename W>
void moe_forward(const float* x, int64_t ldx, const float* topk_w, const int64_t* topk_ids, int64_t N,
                 int64_t K_top, const W* w13, int64_t s13e, int64_t s13r, const W* w2, int64_t s2e,
                 int64_t s2r, int64_t E, int64_t H, int64_t I, float* out, int num_threads) {
  const int64_t P = N * K_top;

  // 1. Counting sort of the pairs by expert (stable: tokens keep their order in a group).
  std::vector<int64_t> offs(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = topk_ids[p];
    TORCH_CHECK(e >= 0 && e < E, "fused_moe_cpu: expert id ", e, " out of range [0, ", E, ")");
    offs[e + 1]++;
  }
  for (int64_t e = 0; e < E; ++e) offs[e + 1] += offs[e];
  std::vector<int64_t> fill(offs.begin(), offs.end() - 1);
  std::vector<int64_t> tok(P), pair(P);
  std::vector<float> wgt(P);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t q = fill[topk_ids[p]]++;
    tok[q] = p / K_top;
    pair[q] = p;
    wgt[q] = topk_w[p];
  }
  std::vector<int64_t> active;  // experts that received tokens, ascending
  for (int64_t e = 0; e < E; ++e)
    if (offs[e + 1] > offs[e]) active.push_back(e);
  const int64_t A = static_cast<int64_t>(active.size());

  // Per-pair pointers: the token's activation row, and its intermediate row.
  std::unique_ptr<float[]> hbuf(new float[static_cast<size_t>(P) * I]);  // no zero-fill: fully written
  // Each (token, rank) pair's weighted output, summed per token in rank order at the end: the sum
  // then does not depend on which slots the expert store gave the experts (with three or more
  // experts per token, adding them in slot order would round differently from one pool layout to
  // the next, and offloaded runs would drift from resident ones).
  std::unique_ptr<float[]> obuf(new float[static_cast<size_t>(P) * H]);  // fully written below
  std::vector<const float*> xrow(P), hrow(P);
  for (int64_t q = 0; q < P; ++q) {
    xrow[q] = x + tok[q] * ldx;
    hrow[q] = hbuf.get() + q * I;
  }

  // A small layer (a few hundred KB of weights) is done in microseconds by one thread; handing
  // work to another would cost more, and much more when another process holds a core.
  const double bytes = static_cast<double>(A) * 3.0 * H * I * sizeof(W) + 4.0 * P * (H + I);
  // what this call streams of the experts' rows (and, int8, of their scales): weight_stats
  count_weights(1, std::is_same_v<W, float> ? torch::kFloat32 : std::is_same_v<W, int8_t> ? torch::kChar
                   : std::is_same_v<W, moebench_cpu::Q4> ? torch::kByte : torch::kBFloat16,
                A * (2 * I * s13r + H * s2r) * static_cast<int64_t>(sizeof(W)));
  if (bytes < kMinParallelBytes) num_threads = 1;

  // a gate/up item reads twice its block's rows: its gate rows and its up rows
  const int64_t gate_up_block = moebench_cpu::streamed_item_rows(
      s13r * static_cast<int64_t>(sizeof(W)), 2 * kMinGateUpBlock, 2 * kMaxGateUpBlock, num_threads,
      [&](int64_t rows) { return A * ((2 * I + rows - 1) / rows); }) / 2;
  const int64_t down_block = moebench_cpu::streamed_item_rows(
      s2r * static_cast<int64_t>(sizeof(W)), kMinDownBlock, kMaxDownBlock, num_threads,
      [&](int64_t rows) { return A * ((H + rows - 1) / rows); });
  const int64_t nb_gu = (I + gate_up_block - 1) / gate_up_block;
  const int64_t nb_dn = (H + down_block - 1) / down_block;

  // int4 experts, or int8 experts with their row scales, with q8 activations (q8_cpu.h, approximate):
  // the tokens quantized once here, each pair's intermediate row once between the phases; every
  // expert's rows meet them 3 at a time
  constexpr bool kQ8Rows = std::is_same_v<W, moebench_cpu::Q4> || std::is_same_v<W, int8_t>;
  const bool q8_asked = kQ8Rows && moebench_cpu::q8_activations();
  const bool q8 = q8_asked && H % moebench_cpu::kQ4Values == 0 && I % moebench_cpu::kQ4Values == 0;
  if (q8_asked && !q8)
    TORCH_WARN_ONCE("moebench: q8 ACTIVATIONS NOT APPLIED: experts of ", H, " x ", I, " values (not whole blocks of ",
                    moebench_cpu::kQ4Values, ") meet float32 activations");
  moebench_cpu::Q8Tokens xq8, hq8;
  std::vector<int64_t> seq;
  if (q8) {
    xq8.resize(N, H);
    for (int64_t t = 0; t < N; ++t) xq8.quantize(t, x + t * ldx);
    hq8.resize(P, I);
    seq.resize(P);
    for (int64_t q = 0; q < P; ++q) seq[q] = q;
    moebench_cpu::g_q8_activation_rows.fetch_add(N + P, std::memory_order_relaxed);
  }

  // 2. gate/up with SiLU(gate) * up, one item per (active expert, intermediate-row block).
  parallel_for(A * nb_gu, num_threads, [&](int64_t item) {
    const int64_t e = active[item / nb_gu];
    const int64_t j0 = (item % nb_gu) * gate_up_block, j1 = std::min(I, j0 + gate_up_block);
    const int64_t q0 = offs[e], n = offs[e + 1] - offs[e];
    const W* we = w13 + e * s13e;
    const float* const* xs = xrow.data() + q0;
    float* hb = hbuf.get() + q0 * I;
    // the block's m gate rows, then its m up rows, as one run of 2m rows; o[i * n + t] their dots
    const int64_t m = j1 - j0;
    auto row = [&](int64_t i) { return we + (i < m ? j0 + i : I + j0 + i - m) * s13r; };
    auto silu_gate_times_up = [&](const float* o) {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t jj = 0; jj < m; ++jj)
          hb[t * I + j0 + jj] = silu(scaled(o[jj * n + t], row(jj), H)) * scaled(o[(m + jj) * n + t], row(m + jj), H);
    };
    if constexpr (kQ8Rows) {
      if (q8) {
        thread_local std::vector<float> o;
        o.resize(static_cast<size_t>(2 * m * n));
        moebench_cpu::q8_dot_rows(row, 2 * m, xq8, tok.data() + q0, n, o.data());
        silu_gate_times_up(o.data());
        return;
      }
    }
    if (n <= 3) {  // the block's gate rows and up rows read as streams (cpu_common.h)
      float o[2 * kMaxGateUpBlock * 3];
      dot_rows_streamed<RowSum::kMoe, W>(row, 2 * m, n, xs, H, o);
      silu_gate_times_up(o);
      return;
    }
    moebench_cpu::count_tiled_rows(8 * ((j1 - j0) / 4));  // the rows rows8_tokens reads
    int64_t j = j0;
    // Groups of 4 intermediate rows: gate rows j..j+3 and up rows I+j..I+j+3.
    for (; j + 4 <= j1; j += 4) {
      const W* rows[8];
      for (int g = 0; g < 4; ++g) {
        rows[g] = we + (j + g) * s13r;
        rows[4 + g] = we + (I + j + g) * s13r;
      }
      rows8_tokens(rows, xs, n, H, [&](int64_t t0, int tt, const float* o) {
        for (int t = 0; t < tt; ++t)
          for (int g = 0; g < 4; ++g)
            hb[(t0 + t) * I + j + g] = silu(scaled(o[g * tt + t], rows[g], H)) * scaled(o[(4 + g) * tt + t], rows[4 + g], H);
      }, 4 * s13r);
    }
    for (; j < j1; ++j) {
      const W* rows[2] = {we + j * s13r, we + (I + j) * s13r};
      rows2_tokens(rows, xs, n, H, [&](int64_t t0, int tt, const float* o) {
        for (int t = 0; t < tt; ++t) hb[(t0 + t) * I + j] = silu(scaled(o[t], rows[0], H)) * scaled(o[tt + t], rows[1], H);
      });
    }
  });

  // 3. down projection times the routed weight, one item per (active expert, block of output
  // rows): each item streams one contiguous run of the expert's rows and writes its (token, rank)
  // pairs' output rows, which no other item writes.
  float* ob = obuf.get();
  if (q8)
    for (int64_t q = 0; q < P; ++q) hq8.quantize(q, hrow[q]);
  parallel_for(A * nb_dn, num_threads, [&](int64_t item) {
    const int64_t e = active[item / nb_dn];
    const int64_t r0 = (item % nb_dn) * down_block, r1 = std::min(H, r0 + down_block);
    const int64_t q0 = offs[e], n = offs[e + 1] - offs[e];
    const W* we = w2 + e * s2e;
    const float* const* hs = hrow.data() + q0;
    const int64_t* pr = pair.data() + q0;
    const float* wq = wgt.data() + q0;
    // the block's m rows; o[i * n + t] their dots, times each pair's routed weight into its output row
    const int64_t m = r1 - r0;
    auto row = [&](int64_t i) { return we + (r0 + i) * s2r; };
    auto routed_rows = [&](const float* o) {
      for (int64_t t = 0; t < n; ++t) {
        float* dst = ob + pr[t] * H + r0;
        const float sw = wq[t];
        for (int64_t i = 0; i < m; ++i) dst[i] = sw * scaled(o[i * n + t], row(i), I);
      }
    };
    if constexpr (kQ8Rows) {
      if (q8) {
        thread_local std::vector<float> o;
        o.resize(static_cast<size_t>(m * n));
        moebench_cpu::q8_dot_rows(row, m, hq8, seq.data() + q0, n, o.data());
        routed_rows(o.data());
        return;
      }
    }
    if (n <= 3) {  // the block's rows read as streams (cpu_common.h)
      float o[kMaxDownBlock * 3];
      dot_rows_streamed<RowSum::kMoe, W>(row, m, n, hs, I, o);
      routed_rows(o);
      return;
    }
    moebench_cpu::count_tiled_rows(8 * ((r1 - r0) / 8));  // the rows rows8_tokens reads
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) {
      const W* rows[8];
      for (int g = 0; g < 8; ++g) rows[g] = we + (r + g) * s2r;
      rows8_tokens(rows, hs, n, I, [&](int64_t t0, int tt, const float* o) {
        for (int t = 0; t < tt; ++t) {
          float* dst = ob + pr[t0 + t] * H + r;
          const float sw = wq[t0 + t];
          for (int g = 0; g < 8; ++g) dst[g] = sw * scaled(o[g * tt + t], rows[g], I);
        }
      }, 8 * s2r);
    }
    for (; r + 2 <= r1; r += 2) {
      const W* rows[2] = {we + r * s2r, we + (r + 1) * s2r};
      rows2_tokens(rows, hs, n, I, [&](int64_t t0, int tt, const float* o) {
        for (int t = 0; t < tt; ++t) {
          float* dst = ob + pr[t0 + t] * H + r;
          const float sw = wq[t0 + t];
          dst[0] = sw * scaled(o[t], rows[0], I);
          dst[1] = sw * scaled(o[tt + t], rows[1], I);
        }
      });
    }
    for (; r < r1; ++r) {
      const W* row = we + r * s2r;
      for (int64_t t = 0; t < n; ++t) {
        float o;
        dot_tile<1, 1>(&row, hs + t, I, &o);
        ob[pr[t] * H + r] = wq[t] * scaled(o, row, I);
      }
    }
  });

  // 4. top-k sum, each token's experts in rank order (never in slot order: see obuf above)
  parallel_for(N, num_threads, [&](int64_t t) {
    const float* src = ob + t * K_top * H;
    float* dst = out + t * H;
    for (int64_t r = 0; r < H; ++r) dst[r] = src[r];
    for (int64_t j = 1; j < K_top; ++j)
      for (int64_t r = 0; r < H; ++r) dst[r] += src[j * H + r];
  });
}

}  // namespace

// x [N, H] float32 (last dim contiguous), topk_weights [N, k] float32, topk_ids [N, k] int64,
// w13 [E, 2I, H] and w2 [E, H, I] float32 or bfloat16 (last dims contiguous), or int8 rows with their
// scales, [E, 2I, H + 8] and [E, H, I + 8] (cpu_common.h). Returns [N, H] float32.
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids, torch::Tensor w13,
                        torch::Tensor w2) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "fused_moe_cpu: x must be a float32 [N, H] tensor with a contiguous last dimension");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "fused_moe_cpu: w13 must be [E, 2I, H] and w2 [E, H, I]");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type() &&
                  moebench_cpu::weight_format(w13.scalar_type(), moebench_cpu::kExpertWeights) != nullptr,
              "fused_moe_cpu: w13 and w2 must be of one of: ", moebench_cpu::accepted_formats(moebench_cpu::kExpertWeights));
  TORCH_CHECK(w13.stride(2) == 1 && w2.stride(2) == 1, "fused_moe_cpu: weight rows must be contiguous");
  const int64_t N = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  const bool packed = w13.scalar_type() == torch::kChar;
  // int8 rows carry their scale, int4 rows are Q4_0 blocks (weight_format.h: stored_width)
  const auto& format = *moebench_cpu::weight_format(w13.scalar_type(), moebench_cpu::kExpertWeights);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == moebench_cpu::stored_width(format, H) &&
                  moebench_cpu::takes_rows(w13, H, moebench_cpu::kExpertWeights),
              "fused_moe_cpu: w13 shape ", w13.sizes(), " does not match hidden size ", H);
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == H && w2.size(2) == moebench_cpu::stored_width(format, I) &&
                  moebench_cpu::takes_rows(w2, I, moebench_cpu::kExpertWeights),
              "fused_moe_cpu: w2 shape ", w2.sizes(), " does not match w13 ", w13.sizes());
  TORCH_CHECK(!packed || (packed_int8(w13, H) && packed_int8(w2, I)),
              "fused_moe_cpu: int8 rows must be 4-byte aligned, with widths that are multiples of 4");
  auto tw = topk_weights.to(torch::kFloat32).contiguous();
  auto ti = topk_ids.to(torch::kInt64).contiguous();
  TORCH_CHECK(ti.dim() == 2 && ti.size(0) == N && tw.sizes() == ti.sizes(),
              "fused_moe_cpu: topk_weights and topk_ids must both be [N, k]");
  auto out = torch::empty({N, H}, x.options());
  // Release the GIL: a prefetch thread may load the next layer's experts meanwhile.
  pybind11::gil_scoped_release no_gil;
  fused_moe_into(x.data_ptr<float>(), x.stride(0), N, tw.data_ptr<float>(), ti.data_ptr<int64_t>(), ti.size(1), w13,
                 w2, out.data_ptr<float>());
  return out;
}

void fused_moe_into(const float* x, int64_t ldx, int64_t N, const float* tw, const int64_t* ti, int64_t k,
                    const torch::Tensor& w13, const torch::Tensor& w2, float* out) {
  if (N == 0) return;
  const int64_t H = w2.size(1), E = w13.size(0), I = w13.size(1) / 2;
  const int threads = moebench_cpu::step_threads();
  if (w13.scalar_type() == torch::kByte) {  // int4 rows (int4_cpu.h)
    using moebench_cpu::Q4;
    moe_forward<Q4>(x, ldx, tw, ti, N, k, reinterpret_cast<const Q4*>(w13.data_ptr<uint8_t>()), w13.stride(0),
                    w13.stride(1), reinterpret_cast<const Q4*>(w2.data_ptr<uint8_t>()), w2.stride(0), w2.stride(1), E, H,
                    I, out, threads);
  } else if (w13.scalar_type() == torch::kChar) {
    moe_forward<int8_t>(x, ldx, tw, ti, N, k, w13.data_ptr<int8_t>(), w13.stride(0), w13.stride(1),
                        w2.data_ptr<int8_t>(), w2.stride(0), w2.stride(1), E, H, I, out, threads);
  } else if (w13.scalar_type() == torch::kFloat32) {
    moe_forward<float>(x, ldx, tw, ti, N, k, w13.data_ptr<float>(), w13.stride(0), w13.stride(1),
                       w2.data_ptr<float>(), w2.stride(0), w2.stride(1), E, H, I, out, threads);
  } else {
    moe_forward<at::BFloat16>(x, ldx, tw, ti, N, k, w13.data_ptr<at::BFloat16>(), w13.stride(0), w13.stride(1),
                              w2.data_ptr<at::BFloat16>(), w2.stride(0), w2.stride(1), E, H, I, out, threads);
  }
}

// attention_cpu.cpp, built into the same extension: decode attention over the paged KV cache
void register_attention(pybind11::module& m);
// norms_cpu.cpp: residual add + RMSNorm
void register_norms(pybind11::module& m);
// routing_cpu.cpp: the router's top-k and a step's routing summary
void register_routing(pybind11::module& m);
// dense_cpu.cpp: the step's thread pool and dense projections for few tokens
void register_pool(pybind11::module& m);
void register_dense(pybind11::module& m);
// decode_layer.cpp: chains of the decode step's ops, one call each
void register_decode_layer(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_moe", &fused_moe, "Fused MoE forward on CPU (float32 activations, float32/bfloat16 weights or int8 rows with their scales)");
  register_attention(m);
  register_norms(m);
  register_routing(m);
  register_pool(m);
  register_dense(m);
  register_decode_layer(m);
}
