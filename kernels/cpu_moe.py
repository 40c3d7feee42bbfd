"""CPU fused MoE: a C++ extension (AVX2/FMA, split over the kernels' own thread pool), with a grouped-torch fallback.

At decode time a CPU MoE layer is a memory-bandwidth problem: each routed expert's weights
(3 * H * I values) are read once per step and meet only a few tokens. torch's skinny matmuls
reach a fraction of the read bandwidth on such shapes, and the per-expert Python loop adds
gathers, scatters and dispatch per expert. The extension in `csrc/moe_cpu.cpp` does the whole
layer in one call (sort once, fused gate/up + SiLU, down projection with the routed weight
and top-k sum), streaming the weights with vectorised multi-row, multi-token dot products.

It is compiled at first use in each Python environment by `build.build_extension` (needs the
system C++ compiler and ninja; about 2 min 20 s on a 2-core machine, announced; cached per
environment under ~/.cache/moebench/extensions afterwards, see docs/kernels.md "Building").
If that fails, or the CPU lacks AVX2/FMA, `fused_moe_cpu` warns once and runs the same fused
algorithm with grouped torch ops. `cpu_backend()` says which one runs. The overrides' `moe_op=torch`
(engine/overrides.py) runs `fused_moe_cpu_torch` for the MoE op alone; the extension's other ops
are not touched by it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .align import sort_by_expert
from .build import Extension, LazyExtension, build_extension

__all__ = ["fused_moe_cpu", "fused_moe_cpu_torch", "cpu_backend", "cpp_kernel_takes", "load_extension", "loaded_extension",
           "weight_formats"]

log = logging.getLogger("moebench.kernels")

CSRC = Path(__file__).resolve().parent / "csrc" / "moe_cpu.cpp"
CSRC_ATTENTION = CSRC.with_name("attention_cpu.cpp")  # paged decode attention, same extension
CSRC_NORMS = CSRC.with_name("norms_cpu.cpp")  # residual add + RMSNorm, sums in torch's order, same extension
CSRC_ROUTING = CSRC.with_name("routing_cpu.cpp")  # the router's top-k and routing summary, same extension
CSRC_POOL = CSRC.with_name("pool.cpp")  # the step's thread pool and the overrides' entry point, same extension
CSRC_DENSE = CSRC.with_name("dense_cpu.cpp")  # dense projections and the LM head, same extension
CSRC_DECODE_LAYER = CSRC.with_name("decode_layer.cpp")  # chains of the decode step's ops, same extension
# No contraction of a * b + c into one fused multiply-add where the source does not ask for one
# (explicit FMA intrinsics are unaffected): contracted, `out += w * y` rounds differently depending
# on which of a token's experts is added first, i.e. on the slots the expert store happened to pick,
# and offloaded runs would no longer match resident ones bit for bit.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off"]
EXTENSION = Extension("moebench_moe_cpu", "the CPU MoE kernel and decode attention",
                      (CSRC, CSRC_ATTENTION, CSRC_NORMS, CSRC_ROUTING, CSRC_POOL, CSRC_DENSE, CSRC_DECODE_LAYER),
                      tuple(CFLAGS), (),
                      estimate="about 2 min 20 s on a 2-core machine, up to 80 s more under load",
                      headers=tuple(CSRC.with_name(h) for h in ("cpu_common.h", "spin.h", "norms_cpu.h", "pool.h", "ops.h",
                                                                "weight_format.h", "distinct_experts.h",
                                                                "int4_cpu.h", "q8_cpu.h")))

BACKEND_CPP = "cpp-avx2-pool"
BACKEND_TORCH = "torch-grouped"
BACKEND_LOOP = "torch-per-expert-loop"  # inside BACKEND_TORCH, where torch._grouped_mm is unavailable


def _build():
    if not torch.cpu._is_avx2_supported():
        raise RuntimeError("this CPU has no AVX2/FMA")
    return build_extension(EXTENSION)


_extension = LazyExtension("the CPU MoE kernel", build=lambda: _build(),
                           fallback="using the grouped torch fallback (same algorithm, slower)")


def load_extension():
    """The compiled extension module, building it on first call; None if unavailable."""
    return _extension.get()


def loaded_extension():
    """The extension where this process has loaded it already, else None; never builds it."""
    return _extension.module


def cpu_backend() -> str:
    """Which CPU fused-MoE implementation runs: 'cpp-avx2-pool' or 'torch-grouped'.
    Builds the extension if that has not been tried yet."""
    return BACKEND_CPP if load_extension() is not None else BACKEND_TORCH


_formats: dict[str, dict] = {}


def weight_formats(use: str) -> dict:
    """The weight formats the C++ kernels take for `use` (dense, experts, lm_head), by torch dtype: the
    extension's one table (kernels/csrc/weight_format.h: row layout, extra bytes per row, whether a
    row-scale tensor comes with it); empty where the extension did not build (nothing streams)."""
    if use not in _formats:
        ext = load_extension()
        if ext is None:
            return {}
        _formats[use] = {getattr(torch, f.get("torch_dtype", f["dtype"])): f for f in ext.weight_formats()
                         if use in f["uses"]}
    return _formats[use]


def cpp_kernel_takes(w13: Tensor, w2: Tensor) -> bool:
    """Whether the C++ kernel computes with these expert weights as they are (CPU tensors of one dtype
    it streams: weight_formats("experts")); other weights take the torch fallback."""
    return w13.device.type == "cpu" and w13.dtype == w2.dtype and w13.dtype in weight_formats("experts")


def fused_moe_cpu(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
                  backends: dict | None = None) -> Tensor:
    """Fused SwiGLU MoE on CPU. x [N, H]; topk_weights/topk_ids [N, k]; w13 [E, 2I, H]; w2 [E, H, I].

    float32 weights (and bfloat16 weights, widened in registers, and int8 rows with their scales,
    --weights int8) run in the C++ kernel with float32 activations and accumulation; other dtypes,
    or a missing extension, use the torch fallback (int8 rows dequantized to x's dtype first). Returns [N, H] in x.dtype. `backends` (a dict), when given, counts the implementation
    that computed the call: BACKEND_CPP, BACKEND_TORCH, and BACKEND_LOOP per matmul that fell back
    from the grouped one to a per-expert loop (the activation evidence of kernel=fused).
    """
    ext = load_extension()
    if ext is not None and cpp_kernel_takes(w13, w2) and x.dtype in (torch.float32, torch.bfloat16):
        xf = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
        if w13.stride(-1) != 1:
            w13 = w13.contiguous()
        if w2.stride(-1) != 1:
            w2 = w2.contiguous()
        out = ext.fused_moe(xf, topk_weights, topk_ids, w13, w2)
        if backends is not None:
            backends[BACKEND_CPP] = backends.get(BACKEND_CPP, 0) + 1
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    return fused_moe_cpu_torch(x, topk_weights, topk_ids, w13, w2, backends)


def _grouped_mm_ok() -> bool:
    return hasattr(torch, "_grouped_mm")


def fused_moe_cpu_torch(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
                        backends: dict | None = None) -> Tensor:
    """The fused algorithm in torch ops: sort the pairs once, one grouped matmul for gate and up
    together, SiLU(gate) * up, one grouped matmul for down, routed weight, top-k sum.
    No per-expert Python loop when torch._grouped_mm is available (torch >= 2.8 on CPU)."""
    if w13.dtype == torch.int8:  # int8 rows with their scales: dequantized for the grouped matmuls
        from .int4_torch import warn_float_activations
        from .reference import unpack_int8_rows

        warn_float_activations("the fused MoE op in torch", loaded_extension(), "int8")

        w13, w2 = ((v.to(x.dtype) * s[..., None].to(x.dtype)) for v, s in map(unpack_int8_rows, (w13, w2)))
    elif w13.dtype == torch.uint8:  # int4 rows (docs/int4.md): no C++ kernel took them, the slow path
        from .int4_torch import dequantized, warn_float_activations, warn_slow_path

        warn_slow_path("the fused MoE op")
        warn_float_activations("the fused MoE op in torch", loaded_extension())
        w13, w2 = dequantized(w13, x.dtype), dequantized(w2, x.dtype)
    n, k = topk_ids.shape
    e, two_i, h_dim = w13.shape
    inter = two_i // 2
    if backends is not None:
        backends[BACKEND_TORCH] = backends.get(BACKEND_TORCH, 0) + 1
    if n == 0:
        return torch.zeros_like(x)
    order, offsets = sort_by_expert(topk_ids, e)
    token = order // k
    xs = x[token].to(w13.dtype)
    gate_up = _grouped_linear(xs, w13, offsets, backends)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = _grouped_linear(h, w2, offsets, backends)
    y = y * topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
    # Back to pair order, then the k rows of each token are adjacent: the top-k sum is a view sum.
    y_pairs = torch.empty_like(y)
    y_pairs[order] = y
    return y_pairs.view(n, k, h_dim).sum(dim=1).to(x.dtype)


def _grouped_linear(a: Tensor, w: Tensor, offsets: Tensor, backends: dict | None = None) -> Tensor:
    """Rows of `a` grouped by expert (offsets [E+1]) times w[e].T for each group."""
    if _grouped_mm_ok() and a.dtype == w.dtype and a.dtype in (torch.float32, torch.bfloat16):
        try:
            return torch._grouped_mm(a.contiguous(), w.transpose(1, 2), offs=offsets[1:].to(torch.int32))
        except RuntimeError as e:  # layout or dtype this build does not support
            log.debug("torch._grouped_mm failed (%s); looping over experts", e)
    # Still one pass per expert over contiguous rows, no masks: only the matmul is per expert.
    if backends is not None:
        backends[BACKEND_LOOP] = backends.get(BACKEND_LOOP, 0) + 1
    out = a.new_empty(a.shape[0], w.shape[1])
    bounds = offsets.tolist()
    for expert in range(w.shape[0]):
        lo, hi = bounds[expert], bounds[expert + 1]
        if hi > lo:
            torch.matmul(a[lo:hi], w[expert].T, out=out[lo:hi])
    return out
