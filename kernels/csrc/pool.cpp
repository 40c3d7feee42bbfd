// The decode step's thread pool (pool.h), the context a decode step runs in, and the extension's one
// entry point for overrides (set_overrides: engine/overrides.py hands them in; nothing here reads
// the environment).
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
// Waiting workers spin for a short while (the pool_spin_us override: the gap between two sections of a
// step is shorter than waking a sleeping thread), then sleep on a futex; spin.h says when they
// do not spin at all.

#include "pool.h"
#include "spin.h"

#include <torch/extension.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moebench_cpu {

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

// How long an idle worker spins before it sleeps: the pool_spin_us override (set_overrides).
std::atomic<int64_t> g_spin_us{200};

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
      const auto waiting_since = std::chrono::steady_clock::now();
      spin_until([&] { return done_.load(std::memory_order_acquire) >= n; }, std::chrono::microseconds(1000000));
      while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();
      caller_waits_.fetch_add(1, std::memory_order_relaxed);
      caller_wait_ns_.fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - waiting_since).count(),
          std::memory_order_relaxed);
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
  int64_t caller_waits() const { return caller_waits_.load(std::memory_order_relaxed); }
  int64_t caller_wait_ns() const { return caller_wait_ns_.load(std::memory_order_relaxed); }
  int workers() const { return static_cast<int>(workers_.size()); }

 private:
  Pool() = default;

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
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; },
                      std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed)))) {
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
  // sections whose calling thread, its own items done, waited for a worker's last item, and how long in
  // all: the time a section's end leaves one thread idle (decode_breakdown.py reports it per step)
  std::atomic<int64_t> caller_waits_{0};
  std::atomic<int64_t> caller_wait_ns_{0};
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

// The entry point the other kernels of the extension call (declared in pool.h).
void parallel_run(int64_t n, int threads, ItemFn fn, void* context) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(context, i);
    return;
  }
  Pool::instance().run(n, threads, fn, context);
}
}  // namespace moebench_cpu

namespace moebench_cpu {
namespace {

std::atomic<bool> g_avx512_allowed{true};
std::atomic<bool> g_avx512_fixed{false};  // a kernel asked: the choice is made for this process

}  // namespace

bool avx512_allowed() {
  g_avx512_fixed.store(true);
  return g_avx512_allowed.load();
}

}  // namespace moebench_cpu

namespace {

// The overrides of this process (engine/overrides.py apply_process_overrides): whether the AVX-512
// kernels may run, and how long an idle pool worker spins. False, and nothing changed, where the
// AVX-512 choice was made already the other way (it is made once per process, by the first kernel).
bool set_overrides(bool avx512, int64_t pool_spin_us) {
  TORCH_CHECK(pool_spin_us >= 0, "set_overrides: pool_spin_us must be >= 0");
  if (moebench_cpu::g_avx512_fixed.load() && moebench_cpu::g_avx512_allowed.load() != avx512) return false;
  moebench_cpu::g_avx512_allowed.store(avx512);
  moebench_cpu::g_spin_us.store(pool_spin_us, std::memory_order_relaxed);
  return true;
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
  d["caller_waits"] = pool.caller_waits();
  d["caller_wait_ns"] = pool.caller_wait_ns();
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
    moebench_cpu::parallel_for(n, static_cast<int>(threads), [&](int64_t i) { marks[i].fetch_add(1, std::memory_order_relaxed); });
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

void register_pool(pybind11::module& m) {
  m.def("set_overrides", &set_overrides, "The process's overrides: AVX-512 kernels allowed, the pool's spin in "
        "microseconds; False where the AVX-512 choice was made already the other way",
        pybind11::arg("avx512"), pybind11::arg("pool_spin_us"));
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
  m.def("pool_stats", &pool_stats, "The step thread pool: workers, parallel sections run, items run by workers, times a worker slept, "
        "spins not begun because the machine had more runnable threads than cores, sections whose calling "
        "thread waited for a worker's last item and the nanoseconds it waited in all");
}
