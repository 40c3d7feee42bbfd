// Expert loads that never take the GIL: a pool of native worker threads that copy experts from a
// slow tier (host memory, or a file read past the page cache) into fast-pool slots, upcasting
// bfloat16/float16 to float32 where the slot wants it.
//
// Why native: the prefetcher's loads overlap the model's own thread. A Python worker has to take
// the GIL to pick up a job, to call the copy and to complete a future; each hand-over stalls the
// model's thread (which needs the GIL between every two torch ops) and on a 2-core machine costs a
// scheduler slice. Here the model's thread takes the GIL only to describe the loads; the workers
// never touch Python objects.
//
// A load: optionally read [offset, offset + length) of a file descriptor into the worker's aligned
// buffer (O_DIRECT needs aligned offsets, lengths and addresses: the caller rounds them), check at
// least `needed` bytes came back, then copy segments (src -> dst, with a conversion kind) where a
// segment's src is an address in memory, or an offset into the read buffer when a file is read.
#pragma once

#include <torch/extension.h>

#include "spin.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace moebench_loader {

enum Kind : int { kCopy = 0, kBf16ToF32 = 1, kF16ToF32 = 2 };
enum State : int { kQueued = 0, kRunning = 1, kDone = 2, kFailed = 3, kCancelled = 4 };

struct Segment {
  int64_t src;  // address, or offset into the read buffer
  int64_t dst;  // address
  int64_t src_bytes;
  int kind;
};

struct Load {
  int fd = -1;
  int64_t offset = 0, length = 0, needed = 0;
  bool fadvise = false;  // drop cached pages before and after a buffered read
  std::string label;     // the file, for error messages
  std::vector<Segment> segments;
  std::atomic<int> state{kQueued};
  std::string error;
};

using moebench_spin::Clock;
using moebench_spin::spin_until;

struct LoadError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void convert(const Segment& s, const uint8_t* base) {
  const uint8_t* src = base ? base + s.src : reinterpret_cast<const uint8_t*>(s.src);
  void* dst = reinterpret_cast<void*>(s.dst);
  if (s.kind == kCopy) {
    std::memcpy(dst, src, s.src_bytes);
  } else if (s.kind == kBf16ToF32) {  // exact: a bfloat16 is the top half of a float32
    const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
    const int64_t n = s.src_bytes / 2;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
  } else if (s.kind == kF16ToF32) {
    const c10::Half* in = reinterpret_cast<const c10::Half*>(src);
    float* out = reinterpret_cast<float*>(dst);
    const int64_t n = s.src_bytes / 2;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
  } else {
    throw LoadError("unknown conversion kind " + std::to_string(s.kind));
  }
}

// A page-aligned buffer owned by one thread, grown on demand.
struct ReadBuffer {
  uint8_t* data = nullptr;
  int64_t capacity = 0;
  ~ReadBuffer() { std::free(data); }
  uint8_t* get(int64_t size) {
    if (size > capacity) {
      std::free(data);
      data = nullptr;
      capacity = 0;
      const int64_t rounded = (size + 4095) / 4096 * 4096;
      void* p = nullptr;
      if (posix_memalign(&p, 4096, rounded) != 0) throw LoadError("cannot allocate a read buffer");
      data = static_cast<uint8_t*>(p);
      capacity = rounded;
    }
    return data;
  }
};

// The read buffer of a thread that runs loads itself (the model's thread, for demand loads): one per
// thread, whichever of the loader or the store runs them, as the store's budget counts.
inline ReadBuffer& caller_buffer() {
  thread_local ReadBuffer buffer;
  return buffer;
}

struct Counters {
  std::atomic<int64_t> reads{0}, bytes_read{0};
};

inline void run_load(Load& load, ReadBuffer& buffer, Counters& counters) {
  const uint8_t* base = nullptr;
  if (load.fd >= 0) {
    if (load.fadvise) posix_fadvise(load.fd, load.offset, load.length, POSIX_FADV_DONTNEED);
    uint8_t* buf = buffer.get(load.length);
    int64_t got = 0;
    while (got < load.length) {
      const ssize_t n = pread(load.fd, buf + got, load.length - got, load.offset + got);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw LoadError(load.label + ": read failed at byte " + std::to_string(load.offset + got) + ": " +
                        std::strerror(errno));
      }
      if (n == 0) break;  // end of file
      got += n;
    }
    if (got < load.needed)
      throw LoadError(load.label + ": short read at byte " + std::to_string(load.offset) + ": " + std::to_string(got) + " of " +
                      std::to_string(load.needed) + " bytes (file truncated?)");
    if (load.fadvise) posix_fadvise(load.fd, load.offset, load.length, POSIX_FADV_DONTNEED);
    counters.reads += 1;
    counters.bytes_read += got;
    base = buf;
  }
  for (const Segment& s : load.segments) convert(s, base);
}

inline std::shared_ptr<Load> parse(const py::tuple& t) {
  // (fd, offset, length, needed, fadvise, label, [(src, dst, src_bytes, kind), ...])
  auto load = std::make_shared<Load>();
  load->fd = t[0].cast<int>();
  load->offset = t[1].cast<int64_t>();
  load->length = t[2].cast<int64_t>();
  load->needed = t[3].cast<int64_t>();
  load->fadvise = t[4].cast<bool>();
  load->label = t[5].cast<std::string>();
  for (const auto& item : t[6].cast<py::list>()) {
    auto s = item.cast<py::tuple>();
    load->segments.push_back({s[0].cast<int64_t>(), s[1].cast<int64_t>(), s[2].cast<int64_t>(), s[3].cast<int>()});
  }
  return load;
}

// State shared by a loader, its workers and its tickets (a ticket may outlive its loader).
struct Queue {
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<std::shared_ptr<Load>> loads;
  std::atomic<bool> closed{false}, held{false};
  std::atomic<int64_t> queued{0};  // loads.size(), readable without the lock (spinning workers)
  int sleepers = 0;                // workers blocked on work_cv
  std::atomic<int> spinners{0};    // idle workers spinning for the next load (at most one)
  std::chrono::nanoseconds spin{0};
  Counters counters;

  bool takeable() const { return closed.load() || (!held.load() && queued.load(std::memory_order_acquire) > 0); }

  void wait(const Load& load) {
    if (spin_until([&] { return load.state.load(std::memory_order_acquire) >= kDone; }, spin)) return;
    std::unique_lock<std::mutex> lock(mu);
    done_cv.wait(lock, [&] { return load.state.load() >= kDone; });
  }
  void finish(Load& load, int state) {
    {
      std::lock_guard<std::mutex> lock(mu);
      load.state.store(state);
    }
    done_cv.notify_all();
  }
  // Cancel a load that has not started; true if it will never run.
  bool cancel(Load& load) {
    std::lock_guard<std::mutex> lock(mu);
    int expected = kQueued;
    return load.state.compare_exchange_strong(expected, kCancelled) || expected == kCancelled;
  }
  // Queue loads for the workers, waking as many sleeping ones as there are loads no spinner takes.
  void enqueue(const std::vector<std::shared_ptr<Load>>& batch) {
    int64_t wake = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) throw std::runtime_error("the expert loader is closed");
      for (const auto& load : batch) loads.push_back(load);
      queued.store(static_cast<int64_t>(loads.size()), std::memory_order_release);
      wake = std::min<int64_t>(sleepers, static_cast<int64_t>(batch.size()) - spinners.load());
    }
    for (int64_t i = 0; i < wake; ++i) work_cv.notify_one();
  }
};

// What Python holds for one queued load: cancel it while queued, ask whether it ended, wait for it.
class Ticket {
 public:
  Ticket(std::shared_ptr<Load> load, std::shared_ptr<Queue> queue) : load_(std::move(load)), queue_(std::move(queue)) {}
  bool cancel() { return queue_->cancel(*load_); }
  bool done() const { return load_->state.load() >= kDone; }
  void result() {
    if (!done()) {
      py::gil_scoped_release no_gil;
      queue_->wait(*load_);
    }
    const int state = load_->state.load();
    if (state == kFailed) throw LoadError(load_->error);
    if (state == kCancelled) throw LoadError("the load was cancelled");
  }

 private:
  std::shared_ptr<Load> load_;
  std::shared_ptr<Queue> queue_;
};

class Loader {
 public:
  Loader(int threads, int64_t spin_us, const std::vector<int>& cpus) : queue_(std::make_shared<Queue>()) {
    if (threads < 0) throw std::invalid_argument("threads must be >= 0 (0: a loader for run() only)");
    queue_->spin = std::chrono::microseconds(spin_us);
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus) CPU_SET(cpu, &set);
    for (int i = 0; i < threads; ++i) {
      workers_.emplace_back(work, queue_);
      pthread_setname_np(workers_.back().native_handle(), "moebench-load");  // seen in /proc, top, gdb
      if (!cpus.empty() && pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set) != 0) {
        close();
        throw std::invalid_argument("cannot pin the expert loader's threads to cpus outside this process's set");
      }
    }
  }
  ~Loader() {
    try {
      close();
    } catch (...) {
    }
  }

  std::vector<Ticket> submit(const py::list& loads) {
    if (workers_.empty()) throw std::runtime_error("this loader has no threads: use run()");
    std::vector<std::shared_ptr<Load>> parsed;
    parsed.reserve(loads.size());
    for (const auto& t : loads) parsed.push_back(parse(t.cast<py::tuple>()));
    queue_->enqueue(parsed);
    std::vector<Ticket> tickets;
    tickets.reserve(parsed.size());
    for (auto& load : parsed) tickets.emplace_back(load, queue_);
    return tickets;
  }

  // Loads run now in the calling thread (the baseline's demand loads), the GIL released.
  void run(const py::list& loads) {
    std::vector<std::shared_ptr<Load>> parsed;
    for (const auto& t : loads) parsed.push_back(parse(t.cast<py::tuple>()));
    py::gil_scoped_release no_gil;
    for (auto& load : parsed) run_load(*load, caller_buffer(), queue_->counters);
  }

  // Workers stop taking queued loads while held (tests use it to keep loads queued).
  void hold(bool on) {
    {
      std::lock_guard<std::mutex> lock(queue_->mu);
      queue_->held = on;
    }
    queue_->work_cv.notify_all();
  }

  // Cancel what is queued, let running loads finish, join every worker.
  void close() {
    {
      std::lock_guard<std::mutex> lock(queue_->mu);
      if (queue_->closed) return;
      queue_->closed = true;
      for (auto& load : queue_->loads) {
        int expected = kQueued;
        load->state.compare_exchange_strong(expected, kCancelled);
      }
      queue_->loads.clear();
      queue_->queued.store(0);
    }
    queue_->work_cv.notify_all();
    queue_->done_cv.notify_all();
    if (PyGILState_Check()) {  // a running load never needs the GIL, so waiting for it without is safe
      py::gil_scoped_release no_gil;
      join();
    } else {
      join();
    }
  }

  int64_t reads() const { return queue_->counters.reads.load(); }
  // What the native store (expert_store.cpp) queues its loads on; null for a loader without threads.
  std::shared_ptr<Queue> queue_for_store() const { return workers_.empty() ? nullptr : queue_; }
  // Where loads run in the caller's thread count their reads (any loader's queue will do).
  std::shared_ptr<Queue> counters_queue() const { return queue_; }
  int64_t bytes_read() const { return queue_->counters.bytes_read.load(); }

 private:
  void join() {
    for (auto& w : workers_)
      if (w.joinable()) w.join();
  }

  static void work(std::shared_ptr<Queue> q) {
    ReadBuffer buffer;
    for (;;) {
      std::shared_ptr<Load> load;
      // One idle worker spins, the rest sleep: spinners share the cores with the model's thread,
      // and with eight disk readers all spinning the model slowed down (docs/prefetch.md).
      if (q->spinners.fetch_add(1) == 0) spin_until([&] { return q->takeable(); }, q->spin);
      q->spinners.fetch_sub(1);
      {
        std::unique_lock<std::mutex> lock(q->mu);
        auto ready = [&] { return q->closed || (!q->held && !q->loads.empty()); };
        if (!ready()) {
          ++q->sleepers;
          q->work_cv.wait(lock, ready);
          --q->sleepers;
        }
        if (q->closed) return;
        load = std::move(q->loads.front());
        q->loads.pop_front();
        q->queued.store(static_cast<int64_t>(q->loads.size()), std::memory_order_release);
        int expected = kQueued;
        if (!load->state.compare_exchange_strong(expected, kRunning)) continue;  // cancelled
      }
      int outcome = kDone;
      try {
        run_load(*load, buffer, q->counters);
      } catch (const std::exception& e) {
        load->error = e.what();
        outcome = kFailed;
      }
      q->finish(*load, outcome);
    }
  }

  std::shared_ptr<Queue> queue_;
  std::vector<std::thread> workers_;
};

// Adds the native expert store (expert_store.cpp) to the module.
void register_store(py::module_& m);

}  // namespace moebench_loader
