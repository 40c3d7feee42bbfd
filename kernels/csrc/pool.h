// The decode step's thread pool: parallel sections of short items on the step's threads, and the
// context a decode step runs in (StepThreads). Declared here, defined in pool.cpp; every kernel of
// the moebench_moe_cpu extension runs its parallel work through parallel_for.
#pragma once

#include <cstdint>
#include <type_traits>

namespace moebench_cpu {

using ItemFn = void (*)(void* context, int64_t item);

// fn(context, i) for i in [0, n) on up to `threads` threads of the step's pool, the caller
// included, which waits only for items other threads claimed.
void parallel_run(int64_t n, int threads, ItemFn fn, void* context);
int step_threads();  // the pool's thread count for this step

template <class F>
void parallel_for(int64_t n, int threads, F&& f) {
  parallel_run(n, threads, [](void* c, int64_t i) { (*static_cast<std::remove_reference_t<F>*>(c))(i); }, &f);
}

// Whether the AVX-512 kernels may be chosen: the avx512 override, fixed by the first kernel that
// asks (avx512_streams, cpu_common.h). Set through set_overrides, the extension's one entry point
// for overrides (engine/overrides.py).
bool avx512_allowed();

}  // namespace moebench_cpu
