"""Native expert loads: copy (and upcast) experts into fast-pool slots on threads that never take the GIL.

`csrc/expert_loader.cpp` is a small C++ extension of its own (plain C++, no SIMD flags), compiled at
first use in each Python environment like the CPU MoE kernel (`build.build_extension`, announced). A load is described as plain integers, so the worker threads
never touch a Python object:

    (fd, offset, length, needed, fadvise, label, [(src, dst, src_bytes, kind), ...])

fd = -1: each segment copies `src_bytes` from address `src` to address `dst`; otherwise the worker
first reads `length` bytes at `offset` of the file (into its own page-aligned buffer, so O_DIRECT
works; the caller rounds offset and length), checks at least `needed` came back, and `src` is an
offset into what it read. `kind` converts: COPY (same dtype), BF16_TO_F32, F16_TO_F32 (both exact).

`Loader(threads).submit(loads)` queues loads and returns one ticket each (`cancel()` while queued,
`done()`, `result()` waits with the GIL released and raises `LoadError` on a short or failed read);
`Loader.run(loads)` does them in the calling thread, GIL released (`Loader(0)` has no threads and
only runs); `close()` cancels what is queued and joins the workers. `reads` and `bytes_read` count
the file reads done. `label` (the file) names the file in errors.

The overrides' `expert_loader=python` (engine/overrides.py) keeps a store's loads on Python threads
(the thread-pool path in `moebench.engine.store.expert_store`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .build import Extension, LazyExtension, build_extension

COPY, BF16_TO_F32, F16_TO_F32 = 0, 1, 2
_KINDS = {(torch.bfloat16, torch.float32): BF16_TO_F32, (torch.float16, torch.float32): F16_TO_F32}

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
CSRC = CSRC_DIR / "expert_loader.cpp"
SOURCES = (CSRC, CSRC_DIR / "expert_store.cpp")  # the loader's module and the native store beside it
HEADERS = (CSRC_DIR / "expert_loader.h", CSRC_DIR / "spin.h", CSRC_DIR / "distinct_experts.h")
CFLAGS = ["-O3"]
EXTENSION = Extension("moebench_expert_loader", "the native expert loader and store", SOURCES, tuple(CFLAGS),
                      estimate="about 1 min 30 s on a 2-core machine, up to 40 s more under load", headers=HEADERS)


def _build():
    return build_extension(EXTENSION)


_extension = LazyExtension("the native expert loader", build=lambda: _build(),
                           fallback="loads run on Python threads (same results, more GIL contention)")


def load_extension():
    """The compiled module (Loader, Ticket, LoadError, Store, guess_experts), building it on first call;
    None if unavailable."""
    return _extension.get()


def conversion(src: torch.dtype, dst: torch.dtype) -> int | None:
    """The segment kind that turns `src` values into `dst` ones exactly; None if there is none."""
    return COPY if src == dst else _KINDS.get((src, dst))


def memory_segment(src: torch.Tensor, dst: torch.Tensor) -> tuple[int, int, int, int]:
    """A segment copying tensor `src` into `dst` (both contiguous, same element count)."""
    return src.data_ptr(), dst.data_ptr(), src.nbytes, conversion(src.dtype, dst.dtype)
