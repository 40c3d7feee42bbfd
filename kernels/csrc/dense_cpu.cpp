// The decode step's thread pool, and dense projections (x @ w.T) for few tokens, on the CPU.
//
// Thread pool. A decode step is a chain of short parallel sections (per layer: the qkv and output
// projections, attention, the router, two MoE phases), each a few hundred microseconds to a few
// milliseconds. OpenMP runs each as a team: every thread of the team must arrive at the closing
// barrier, so a team thread that the kernel has not scheduled (the other core busy with another
// job) stalls the section for a scheduler time slice, milliseconds, even when the calling thread
// could have done all the work itself. Here a section is a list of items claimed one at a time
// from a shared counter; the calling thread claims items too and waits only for items another
// thread has claimed and not finished. A worker that wakes late finds nothing left and goes back
// to waiting: it never holds the section up.
//
// Waiting workers spin for a short while (MOEBENCH_POOL_SPIN_US: the gap between two sections of a
// step is shorter than waking a sleeping thread), then sleep on a futex; spin.h says when they
// do not spin at all.
//
// Dense projections. At decode time x has 1-16 rows and w a few MB: a weight row is read once and
// meets every token while it is in L1. Items are blocks of output rows; with up to 3 tokens the
// block's rows are read as four runs side by side (four sequential streams, which one core reads
// faster than one: dot_rows_streamed in cpu_common.h), with more, 4 rows x 3 tokens at a time (12
// accumulators, each loaded weight vector feeds 3 FMAs; up to 6 tokens with AVX-512's registers)
// over chunks of K that stay in L1. torch's matmul on these shapes (MKL) reaches a fraction of the
// read bandwidth and uses the second thread poorly.

#include "cpu_common.h"
#include "spin.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
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

bool avx512_streams() {
  static const bool on = [] {
    const char* env = std::getenv("MOEBENCH_AVX512");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return on;
}

using ItemFn = void (*)(void* context, int64_t item);

namespace {

std::atomic<int64_t> g_spins_refused{0};  // spins not begun because the machine was busy

// Spins until ready() or `spin` has passed; false if it gave up (the caller then sleeps).
template <class Ready>
bool spin_until(Ready ready, std::chrono::microseconds spin) {
  return moebench_spin::spin_until(ready, spin, &g_spins_refused);
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

std::chrono::microseconds spin_from_environment() {
  const char* text = std::getenv("MOEBENCH_POOL_SPIN_US");
  return std::chrono::microseconds(text != nullptr ? std::max(0L, std::strtol(text, nullptr, 10)) : 200);
}

class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool();  // never destroyed: workers may still be parked at exit
    return *pool;
  }

  // Runs fn(context, i) for i in [0, n) on the calling thread and up to threads - 1 workers.
  void run(int64_t n, int threads, ItemFn fn, void* context) {
    std::lock_guard<std::mutex> one_section_at_a_time(section_);
    ensure_workers(threads - 1);
    fn_ = fn;
    context_ = context;
    // released after the previous section's claim_ was closed (below): a worker that reads this
    // count sees the closed claim_ too, so its exchange on an older claim fails
    items_.store(n, std::memory_order_release);
    participants_ = threads - 1;
    done_.store(0, std::memory_order_relaxed);
    const uint32_t generation = generation_.load(std::memory_order_relaxed) + 1;
    claim_.store(static_cast<uint64_t>(generation) << 32, std::memory_order_release);
    generation_.store(generation, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);
    work(generation);
    // wait for items claimed by workers and not finished yet
    if (done_.load(std::memory_order_acquire) < n) {
      spin_until([&] { return done_.load(std::memory_order_acquire) >= n; }, std::chrono::microseconds(1000000));
      while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();
    }
    // Close the section. A worker may have read claim_ as (this generation, n) and be about to
    // compare n with items_: were items_ already the next section's larger count, its exchange
    // on the still-open claim_ would succeed, run the next section's fn_ on a stale item and count
    // it in the next section's done_, which would then end with an item still running (its context
    // gone: a crash in the worker).
    claim_.store((static_cast<uint64_t>(generation) << 32) | kClosed, std::memory_order_release);
    sections_.fetch_add(1, std::memory_order_relaxed);
  }

  int64_t worker_items() const { return worker_items_.load(std::memory_order_relaxed); }
  int64_t sections() const { return sections_.load(std::memory_order_relaxed); }
  int64_t worker_sleeps() const { return worker_sleeps_.load(std::memory_order_relaxed); }
  int workers() const { return static_cast<int>(workers_.size()); }

 private:
  Pool() : spin_(spin_from_environment()) {}

  void ensure_workers(int wanted) {
    while (static_cast<int>(workers_.size()) < wanted) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { worker_loop(index); });
      workers_.back().detach();
    }
  }

  // Claims and runs items of section `generation` until none is left; returns how many it ran.
  int64_t work(uint32_t generation) {
    int64_t ran = 0;
    for (;;) {
      uint64_t claim = claim_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(claim >> 32) != generation) return ran;
      const int64_t item = static_cast<int64_t>(claim & 0xffffffffu);
      // items_ may already belong to a later section; the exchange below then fails (claim_ was
      // closed before items_ changed, see run)
      if (item >= items_.load(std::memory_order_acquire)) return ran;
      if (!claim_.compare_exchange_weak(claim, claim + 1, std::memory_order_acq_rel)) continue;
      fn_(context_, item);
      ++ran;
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void worker_loop(int index) {
    uint32_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; }, spin_)) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        worker_sleeps_.fetch_add(1, std::memory_order_relaxed);
        while (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(&generation_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = generation_.load(std::memory_order_acquire);
      if (index < participants_) worker_items_.fetch_add(work(seen), std::memory_order_relaxed);
    }
  }

  std::mutex section_;
  std::vector<std::thread> workers_;
  const std::chrono::microseconds spin_;
  static constexpr uint64_t kClosed = 0xffffffffu;  // claim_'s item once its section ended: never claimable
  alignas(64) std::atomic<uint64_t> claim_{0};  // (generation << 32) | next unclaimed item
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};  // the futex word workers sleep on
  std::atomic<int> sleepers_{0};
  ItemFn fn_ = nullptr;
  void* context_ = nullptr;
  std::atomic<int64_t> items_{0};
  int participants_ = 0;
  std::atomic<int64_t> worker_items_{0};
  std::atomic<int64_t> sections_{0};
  std::atomic<int64_t> worker_sleeps_{0};
};

}  // namespace

// Threads of the step's parallel sections: set_pool_threads(n) while a decode step runs (torch
// itself is then set to one thread, so its OpenMP team sleeps instead of spinning on the core the
// pool needs), else torch's own thread count.
std::atomic<int> g_pool_threads{0};

int step_threads() {
  const int n = g_pool_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : std::max(1, at::get_num_threads());
}

// The entry point the other kernels of the extension call (declared in cpu_common.h).
void parallel_run(int64_t n, int threads, ItemFn fn, void* context) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(context, i);
    return;
  }
  Pool::instance().run(n, threads, fn, context);
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
  // int8 / fp8 rows: each chunk of the 4 rows is widened once into `wide` (4 KB, in L1) and every
  // token group reads it there; widened in each group's FMA loop instead, it cost more than the
  // multiplies. Chunks do not change the sums (above), so K is always taken in chunks here.
  constexpr bool kWiden = std::is_same_v<W, int8_t> || std::is_same_v<W, c10::Float8_e4m3fn>;
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

}  // namespace

// x [N, K] float32 (rows contiguous), w [M, K] float32 or bfloat16 (rows contiguous), bias [M] or
// None -> [N, M] float32. Items are blocks of output rows (64; with 1-3 tokens sized in bytes,
// streamed_item_rows), run on the step's thread pool.
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "dense_linear: x must be float32 [N, K] with contiguous rows");
  const int64_t N = x.size(0), K = x.size(1), M = w.size(0);
  TORCH_CHECK((w.dim() == 2 && w.stride(1) == 1 && w.size(1) == K &&
               (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16)) ||
                  (w.dim() == 2 && packed_int8(w, K)),
              "dense_linear: w must be float32 or bfloat16 [M, ", K, "] with contiguous rows, or int8 rows with their "
              "scale [M, ", K + moebench_cpu::kPackedExtra, "]; got ", w.scalar_type(), " ", w.sizes());
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
    case torch::kChar:
      if (sp == nullptr) {  // rows that carry their scale: row r's is the float after its K values
        TORCH_CHECK(packed_int8(w, K), "dense_linear_into: int8 weights need a row scale or rows of K + ",
                    moebench_cpu::kPackedExtra, " bytes");
        run(w.data_ptr<int8_t>(), reinterpret_cast<const float*>(w.data_ptr<int8_t>() + K), ldw / 4);
      } else {
        run(w.data_ptr<int8_t>(), sp);
      }
      break;
    case torch::kFloat8_e4m3fn: run(w.data_ptr<c10::Float8_e4m3fn>(), sp); break;
    default: TORCH_CHECK(false, "dense_linear_into: unsupported weight dtype ", w.scalar_type());
  }
}

namespace {

// LM-head projections that ran in the kernel, by weight dtype: calls and bytes streamed (weights
// and row scales). Read by lm_head_stats; the engine reports the difference over a run.
constexpr int kHeadDtypes = 4;
constexpr const char* kHeadDtypeNames[kHeadDtypes] = {"float32", "bfloat16", "int8", "float8_e4m3fn"};
std::atomic<int64_t> g_head_calls[kHeadDtypes];
std::atomic<int64_t> g_head_bytes[kHeadDtypes];

int head_dtype_index(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return 0;
    case torch::kBFloat16: return 1;
    case torch::kChar: return 2;
    case torch::kFloat8_e4m3fn: return 3;
    default: return -1;
  }
}

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
  const bool quantized = w.scalar_type() == torch::kChar || w.scalar_type() == torch::kFloat8_e4m3fn;
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && head_dtype_index(w.scalar_type()) >= 0 && w.size(1) == K, who,
              ": the LM head must be float32, bfloat16, int8 or float8_e4m3fn [vocab, ", K, "] with contiguous rows");
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
      kind[kHeadDtypeNames[i]] = one;
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
    d[kHeadDtypeNames[i]] = one;
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
  return d;
}

// How much of the last sections' work the pool's workers did (activation evidence for 2+ threads).
pybind11::dict pool_stats() {
  pybind11::dict d;
  auto& pool = moebench_cpu::Pool::instance();
  d["workers"] = pool.workers();
  d["sections"] = pool.sections();
  d["worker_items"] = pool.worker_items();
  d["worker_sleeps"] = pool.worker_sleeps();
  d["spins_refused"] = moebench_cpu::g_spins_refused.load(std::memory_order_relaxed);
  return d;
}

// Back-to-back parallel sections of changing sizes, as a decode step runs them, each item marking its
// slot: returns how many sections ended with a slot unmarked or marked twice (the section returned
// before its items were done, or an item ran twice). The pool's regression test.
int64_t pool_selftest(int64_t sections, int64_t threads) {
  TORCH_CHECK(sections >= 0 && threads >= 1, "pool_selftest: sections >= 0 and threads >= 1");
  constexpr int64_t kMaxItems = 64;
  std::vector<std::atomic<int>> marks(kMaxItems);
  int64_t bad = 0;
  pybind11::gil_scoped_release no_gil;
  for (int64_t s = 0; s < sections; ++s) {
    const int64_t n = 2 + (s * 37) % (kMaxItems - 1);
    for (int64_t i = 0; i < n; ++i) marks[i].store(0, std::memory_order_relaxed);
    parallel_for(n, static_cast<int>(threads), [&](int64_t i) { marks[i].fetch_add(1, std::memory_order_relaxed); });
    for (int64_t i = 0; i < n; ++i) {
      if (marks[i].load(std::memory_order_relaxed) != 1) {
        ++bad;
        break;
      }
    }
  }
  return bad;
}

void set_pool_threads(int64_t threads) { moebench_cpu::g_pool_threads.store(static_cast<int>(std::max<int64_t>(0, threads))); }

// A decode step's threads, as a context manager a session makes once (engine/decode_path.py) and
// enters around each decode step: with the pool on, the pool gets torch's thread count and torch one
// thread for the step (an op that opened an OpenMP team with torch at two threads, an argmax over
// the logits, left libgomp's worker spinning for milliseconds on the core the pool's worker needed:
// docs/cpu-decode.md). Inside, it counts the step by the threads it then runs on, read here, where
// the step runs: the evidence of what the pool did, not of what was asked.
class StepThreads {
 public:
  explicit StepThreads(bool pool) : pool_(pool) {}

  StepThreads& enter() {
    torch_threads_ = at::get_num_threads();
    switched_ = pool_ && torch_threads_ > 1;
    if (switched_) {
      moebench_cpu::g_pool_threads.store(torch_threads_);
      at::set_num_threads(1);
    }
    const std::string key = "pool=" + std::to_string(moebench_cpu::step_threads()) +
                            " torch=" + std::to_string(at::get_num_threads());
    ++seen_[key];
    return *this;
  }

  void exit() {
    if (!switched_) return;
    at::set_num_threads(torch_threads_);
    moebench_cpu::g_pool_threads.store(0);
    switched_ = false;
  }

  pybind11::dict seen() const {
    pybind11::dict d;
    for (const auto& [key, steps] : seen_) d[pybind11::str(key)] = steps;
    return d;
  }

 private:
  bool pool_;
  bool switched_ = false;
  int torch_threads_ = 1;
  std::map<std::string, int64_t> seen_;
};

}  // namespace

void register_dense(pybind11::module& m) {
  m.def("set_pool_threads", &set_pool_threads,
        "Threads of the step's parallel sections (0: torch's thread count), see StepThreads");
  m.def("pool_threads", &moebench_cpu::step_threads, "Threads the step's parallel sections use now");
  m.def("pool_selftest", &pool_selftest, "Sections of a back-to-back run whose items were not each run once",
        pybind11::arg("sections"), pybind11::arg("threads"));
  pybind11::class_<StepThreads>(m, "StepThreads",
                                "Around a decode step: the step's threads to the pool (pool=True) and the step "
                                "counted by the threads it ran on (seen)")
      .def(pybind11::init<bool>(), pybind11::arg("pool"))
      .def("__enter__", &StepThreads::enter, pybind11::return_value_policy::reference)
      .def("__exit__", [](StepThreads& s, pybind11::args) { s.exit(); return false; })
      .def("seen", &StepThreads::seen, "Decode steps by the threads they ran on, 'pool=P torch=T'");
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
  m.def("simd_stats", &simd_stats, "The streamed dots' and tiles' kernel in this process (avx512 or avx2) and the rows each one read so far");
  m.def("pool_stats", &pool_stats, "The step thread pool: workers, parallel sections run, items run by workers, times a worker slept, "
        "spins not begun because the machine had more runnable threads than cores");
}
