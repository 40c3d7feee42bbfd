"""Dense projections (`F.linear`) of a decode step on the CPU: the extension's `dense_linear`.

At decode time x has a few rows and the weight is megabytes: the projection is a weight stream.
torch's matmul (MKL) on such shapes reads the weights at a fraction of the memory bandwidth and
gains little from a second thread; `dense_linear` (csrc/dense_cpu.cpp) streams the rows 4 x 3
(rows x tokens) or 8 x 1 at a time and splits blocks of output rows over the step's thread pool,
whose idle threads spin briefly and then sleep (never holding a core another job needs).

Use it wherever a model projects few tokens:

    from moebench.kernels.cpu_dense import linear
    y = linear(x, weight)            # = F.linear(x, weight), [N, K] x [M, K] -> [N, M]
    y = linear(x, weight, bias)

It applies to float32 x on the CPU with at most DENSE_MAX_ROWS rows (decode steps) and float32 or
bfloat16 weights whose rows are contiguous; anything else (prefill, CUDA, other dtypes, no
extension) runs `F.linear`, which is faster for many rows. The result equals `F.linear` to float32
rounding, not bit for bit (the sums run in another order). `MOEBENCH_DENSE_KERNEL=torch` keeps
`F.linear` everywhere (for A/B measurements); `dense_backends()` counts the calls each one ran.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_moe import load_extension

__all__ = ["linear", "dense_backends", "dense_kernel_enabled", "pool_stats", "decode_threads", "DENSE_MAX_ROWS",
           "DISABLE_ENV", "weight_streams", "rows_stream", "count_chained"]

DISABLE_ENV = "MOEBENCH_DENSE_KERNEL"  # =torch: F.linear everywhere
# Above this many rows a projection has enough arithmetic per weight for MKL's blocked GEMM
# (prefill); the streaming kernel is for decode-sized batches.
DENSE_MAX_ROWS = 32
BACKEND_CPP = "cpp-dense"
BACKEND_TORCH = "torch-linear"

_calls: dict[str, int] = {}


def dense_kernel_enabled() -> bool:
    """Whether decode projections may run in the extension (it is built and not switched off)."""
    return os.environ.get(DISABLE_ENV, "kernel") != "torch" and load_extension() is not None


def weight_streams(weight: Tensor) -> bool:
    """Whether `weight` is one the extension's kernel streams: float32 or bfloat16 [M, K], rows contiguous."""
    return weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16) and weight.stride(-1) == 1


def rows_stream(x: Tensor) -> bool:
    """Whether `x` is a decode step's few float32 rows on the CPU."""
    return x.dim() == 2 and x.shape[0] <= DENSE_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`; for a decode step's float32 rows on the CPU, the extension's
    streaming kernel on the step's thread pool."""
    if rows_stream(x) and weight_streams(weight) and dense_kernel_enabled():
        _calls[BACKEND_CPP] = _calls.get(BACKEND_CPP, 0) + 1
        return load_extension().dense_linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
    _calls[BACKEND_TORCH] = _calls.get(BACKEND_TORCH, 0) + 1
    return F.linear(x, weight, bias)


def count_chained(calls: int) -> None:
    """`calls` projections ran in the extension's kernel inside a chain of ops (csrc/decode_layer.cpp)."""
    _calls[BACKEND_CPP] = _calls.get(BACKEND_CPP, 0) + calls


def dense_backends() -> dict[str, int]:
    """Calls of `linear` so far in this process, by the implementation that ran them."""
    return dict(_calls)


def pool_stats() -> dict | None:
    """The step thread pool's counters (workers, parallel sections, items run by workers), or None
    without the extension. Items run by workers are the evidence that a second thread took part."""
    ext = load_extension()
    return dict(ext.pool_stats()) if ext is not None else None


@contextmanager
def decode_threads(enabled: bool = True):
    """For the duration of a decode step: the step's thread pool gets torch's thread count and torch
    itself one thread. A decode step's parallel work (projections, attention, the fused MoE kernel)
    runs on the pool; torch's ops in it are small. With torch left at two threads, an op that opened
    an OpenMP team anyway (an argmax over the logits) left libgomp's worker spinning for milliseconds
    on the core the pool's worker needed: batch 16, 2 threads, 140 -> 165 tok/s with that spinning
    gone (docs/cpu-decode.md). Without the extension, or with one thread, nothing changes."""
    threads = torch.get_num_threads()
    ext = load_extension() if enabled and threads > 1 else None
    if ext is None or not hasattr(ext, "set_pool_threads"):
        yield
        return
    ext.set_pool_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        ext.set_pool_threads(0)
