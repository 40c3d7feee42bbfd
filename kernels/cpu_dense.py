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
extension) runs `F.linear`, which is faster for many rows (a bfloat16 weight with float32 rows is
widened for it first: exact, a copy per call). The result equals `F.linear` to float32
rounding, not bit for bit (the sums run in another order). The overrides' `dense=torch`
(engine/overrides.py) has a model bind `torch_linear` instead, `F.linear` everywhere (for A/B
measurements); `dense_backends()` counts the calls each one ran.

int8 rows that carry their scale (--weights int8, docs/int8.md: `reference.unpack_int8_rows`) stream
through the same kernel, which multiplies each row's sum by its scale; in torch (prefill rows) they run
`reference.rows_linear_reference`. `weight_stats()` says what the kernels streamed, by dtype.

The LM head goes through `lm_head(x, weight, scale)`: the same kernel, which also streams int8 and
fp8 e4m3 heads with a float32 scale per row (--lm-head, docs/lm-head.md), widening them in
registers, and counts what it streamed per weight dtype (`lm_head_stats`, activation evidence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_moe import load_extension, loaded_extension, weight_formats

__all__ = ["linear", "torch_linear", "torch_lm_head", "dense_backends", "dense_kernel_enabled", "pool_stats",
           "DENSE_MAX_ROWS", "weight_streams", "rows_stream", "lm_head", "lm_head_stats",
           "lm_head_stats_torch", "head_streams", "weight_stats"]

# Above this many rows a projection has enough arithmetic per weight for MKL's blocked GEMM
# (prefill); the streaming kernel is for decode-sized batches.
DENSE_MAX_ROWS = 32
BACKEND_CPP = "cpp-dense"
BACKEND_TORCH = "torch-linear"

_calls: dict[str, int] = {}


def dense_kernel_enabled() -> bool:
    """Whether decode projections may run in the extension (it is built)."""
    return load_extension() is not None


def weight_streams(weight: Tensor) -> bool:
    """Whether `weight` is one the extension's kernel streams: float32 or bfloat16 [M, K], or int8 rows
    with their scales [M, K + 8] (--weights int8, reference.unpack_int8_rows), rows contiguous."""
    f = weight_formats("dense").get(weight.dtype)
    return (f is not None and weight.dim() == 2 and weight.stride(-1) == 1
            and (not f["row_extra"] or weight.stride(0) % 4 == 0))


def rows_stream(x: Tensor) -> bool:
    """Whether `x` is a decode step's few float32 rows on the CPU."""
    return x.dim() == 2 and x.shape[0] <= DENSE_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`; for a decode step's float32 rows on the CPU, the extension's
    streaming kernel on the step's thread pool."""
    if rows_stream(x) and weight_streams(weight) and dense_kernel_enabled():
        return load_extension().dense_linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
    return torch_linear(x, weight, bias)


def torch_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` in torch, whatever the rows (int8 rows with their scales through
    the reference, a bfloat16 weight widened exactly): counted as a torch call."""
    _calls[BACKEND_TORCH] = _calls.get(BACKEND_TORCH, 0) + 1
    if weight.dtype in (torch.int8, torch.uint8):  # int8 or int4 rows with their scales (prefill rows, or no kernel)
        from .reference import rows_linear_reference

        name = "int8" if weight.dtype == torch.int8 else "int4"
        from .int4_torch import warn_float_activations

        warn_float_activations("a dense projection" + ("" if rows_stream(x) else " of prefill rows"),
                               loaded_extension(), name)
        if name == "int4" and rows_stream(x):  # a decode step's rows that no C++ int4 kernel streamed
            from .int4_torch import warn_slow_path

            warn_slow_path("a dense projection")
        _torch_weight_calls[name] = _torch_weight_calls.get(name, 0) + 1
        out = rows_linear_reference(x, weight)
        return out + bias if bias is not None else out
    if weight.dtype != x.dtype:  # a bfloat16 checkpoint's matrix, float32 rows (prefill): widened, exactly
        weight = weight.to(x.dtype)
    return F.linear(x, weight, bias)


_torch_head_calls: dict[str, int] = {}
_torch_weight_calls: dict[str, int] = {}  # int8 rows with their scales that ran in torch (weight_stats)


def head_streams(weight: Tensor, scale: Tensor | None) -> bool:
    """Whether the extension's lm_head_linear streams this LM head: [vocab, K] rows contiguous, float32 or
    bfloat16 without a scale, int8 or fp8 e4m3 with a contiguous float32 scale per row
    (weight_formats("lm_head"), the extension's table)."""
    f = weight_formats("lm_head").get(weight.dtype)
    if f is None or not (weight.dim() == 2 and weight.stride(-1) == 1):
        return False
    if not f["scale_tensor"]:
        return scale is None
    return scale is not None and scale.dtype == torch.float32 and scale.is_contiguous() and scale.numel() == weight.shape[0]


def lm_head(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """Logits [N, vocab] float32 = x @ weight.T (times each row's scale, for an int8 or fp8 head).
    A decode step's rows run in the extension's kernel, which widens the stored weights in registers
    and accumulates in float32, and counts what it streamed (lm_head_stats); other rows run
    `F.linear` (a float32 head, as `linear` would) or `reference.lm_head_reference` (a matmul on the
    upcast weight), counted here as torch calls by weight dtype."""
    if rows_stream(x) and head_streams(weight, scale) and dense_kernel_enabled():
        return load_extension().lm_head_linear(x if x.stride(-1) == 1 else x.contiguous(), weight, scale)
    return torch_lm_head(x, weight, scale)


def torch_lm_head(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """`lm_head` in torch, whatever the rows: counted as a torch call by weight dtype."""
    _calls[BACKEND_TORCH] = _calls.get(BACKEND_TORCH, 0) + 1
    name = str(weight.dtype).replace("torch.", "")
    _torch_head_calls[name] = _torch_head_calls.get(name, 0) + 1
    if weight.dtype == torch.int8:
        from .int4_torch import warn_float_activations

        warn_float_activations("the LM head" + ("" if rows_stream(x) else " of prefill rows"), loaded_extension(), "int8")
    if scale is None and weight.dtype == x.dtype:
        return F.linear(x, weight).float()
    from .reference import lm_head_reference

    return lm_head_reference(x, weight, scale)


def lm_head_stats() -> dict:
    """LM-head projections so far in this process: {"kernel": {weight dtype: {"calls", "bytes"}}} as the
    extension counted them where they ran (bytes: the weights and row scales it streamed), and
    {"torch": {weight dtype: calls}} for those that ran in torch (prefill rows, no extension)."""
    ext = load_extension()
    kernel = {k: dict(v) for k, v in ext.lm_head_stats().items()} if ext is not None and hasattr(ext, "lm_head_stats") else {}
    return {"kernel": kernel, "torch": dict(_torch_head_calls)}


def weight_stats() -> dict:
    """Weights the kernels streamed so far in this process, besides the LM head: {"kernel": {"dense":
    {weight dtype: {"calls", "bytes"}}, "experts": {...}}} as the extension counted them (bytes: rows
    and, for int8, their scales), and {"torch": {"int8": calls}}: int8 projections that ran in torch
    (prefill rows, no extension). The activation evidence of --weights (docs/int8.md)."""
    ext = load_extension()
    kernel = ({kind: {k: dict(v) for k, v in d.items()} for kind, d in ext.weight_stats().items()}
              if ext is not None and hasattr(ext, "weight_stats") else {})
    return {"kernel": kernel, "torch": dict(_torch_weight_calls)}


def lm_head_stats_torch() -> dict:
    """The torch part of lm_head_stats alone (loads no extension)."""
    return dict(_torch_head_calls)


def dense_backends() -> dict[str, int]:
    """Dense projections (the LM head's included) so far in this process, by the implementation that
    ran them: the extension's kernel, as it counted them where they ran (weight_stats' dense calls,
    whether `linear` or a chain of ops in csrc/decode_layer.cpp called it, and lm_head_stats' calls),
    and torch, counted here."""
    out = dict(_calls)
    ext = loaded_extension()  # not built here: a process that ran no kernel counted none
    if ext is not None and hasattr(ext, "weight_stats"):
        streamed = sum(c["calls"] for c in ext.weight_stats()["dense"].values())
        streamed += sum(c["calls"] for c in ext.lm_head_stats().values())
        if streamed:
            out[BACKEND_CPP] = streamed
    return out


def pool_stats() -> dict | None:
    """The step thread pool's counters (workers, parallel sections, items run by workers, sections
    whose calling thread waited for a worker's last item and its wait in nanoseconds), or None without
    the extension. Items run by workers are the evidence that a second thread took part."""
    ext = load_extension()
    return dict(ext.pool_stats()) if ext is not None else None
