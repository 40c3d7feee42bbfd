// Spin-then-sleep waiting, shared by the decode step's thread pool (dense_cpu.cpp) and the expert
// loader (expert_loader.h).
//
// Waking a sleeping thread costs tens of microseconds (more on a VM, where the idle vCPU has to be
// woken by the host), as much as a short parallel section or an expert copy; so a waiter spins a
// while before it sleeps. Spinning pays only where a core would otherwise idle. On a busy machine a
// spinner takes CPU time from real work, and not only on its own core: a thread that is always
// runnable makes its core look busy to the kernel's load balancer, so a job that could have moved
// there stays queued behind the spinner. So a spinner gives up as soon as the machine has more
// runnable threads than cores (the running count in /proc/loadavg, checked when the spin starts
// and every few thousand polls), or a yield comes back late (another thread ran on this core).
// Reading /proc/loadavg is three system calls and a walk of every run queue, as long as a short
// parallel section's tail, and the pool's calling thread waits at most sections' ends, dozens of
// times a decode step: read there each time, it held every such end up by that long. So the answer
// is shared by all waiters and read again only once it is kBusyRecheck old.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace moebench_spin {

using Clock = std::chrono::steady_clock;
constexpr auto kLateYield = std::chrono::microseconds(50);
constexpr int kPollsPerYield = 64;
constexpr int kYieldsPerBusyCheck = 32;
constexpr auto kBusyRecheck = std::chrono::milliseconds(1);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// More threads runnable right now than online cores (false where /proc/loadavg cannot be read).
inline bool machine_busy() {
  static const long cpus = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[128];
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* field = buf;  // "0.52 0.58 0.59 3/467 12345": the 4th field is running/total
  for (int i = 0; i < 3 && field != nullptr; ++i) {
    field = std::strchr(field, ' ');
    if (field != nullptr) ++field;
  }
  // the count includes the thread reading it, so "busy" is strictly more runnable threads than cores
  return field != nullptr && std::strtol(field, nullptr, 10) > cpus;
}

// machine_busy() as read at most kBusyRecheck ago, by any thread.
inline bool machine_busy_recently() {
  static std::atomic<int64_t> read_at{0};  // steady clock counts from boot, so 0 is long ago
  static std::atomic<bool> busy{false};
  const int64_t now = Clock::now().time_since_epoch().count();
  const int64_t max_age = std::chrono::duration_cast<Clock::duration>(kBusyRecheck).count();
  if (now - read_at.load(std::memory_order_acquire) < max_age) return busy.load(std::memory_order_relaxed);
  const bool now_busy = machine_busy();
  busy.store(now_busy, std::memory_order_relaxed);
  read_at.store(now, std::memory_order_release);
  return now_busy;
}

// Spins until ready() or `spin` has passed, and returns ready(): false means the caller should
// sleep. A spin the busy machine refused at its start is counted in `refused` where one is given.
template <class Ready, class Duration>
bool spin_until(Ready ready, Duration spin, std::atomic<int64_t>* refused = nullptr) {
  if (ready()) return true;
  if (spin.count() <= 0) return false;
  if (machine_busy_recently()) {
    if (refused != nullptr) refused->fetch_add(1, std::memory_order_relaxed);
    return ready();
  }
  const auto deadline = Clock::now() + spin;
  int yields = 0;
  for (auto now = Clock::now(); now < deadline;) {
    for (int i = 0; i < kPollsPerYield; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
    std::this_thread::yield();
    const auto after = Clock::now();
    if (after - now > kLateYield) break;  // someone else wanted this core: sleep instead
    if (++yields % kYieldsPerBusyCheck == 0 && machine_busy_recently()) break;
    now = after;
  }
  return ready();
}

}  // namespace moebench_spin
