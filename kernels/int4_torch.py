"""int4 rows (--weights int4, docs/int4.md) where no C++ kernel streams them: dequantize, then torch.

The rows are dequantized to float32 on every call (the reference's arithmetic: x @ dequantized.T), so
a decode step reads the 4-bit bytes and then writes and reads a float32 copy about seven times their size:
correct, and far slower than the float32 weights it replaces. It is the slow path, so it says so: a
RuntimeWarning once per process and op, and the activation check fails a run whose decode-step
projections ran here unless fallbacks are accepted (engine/weight_evidence.py). Prefill rows (more
than a decode step's) run here by design, as int8's do, and are not warned about.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .reference import dequantize_int4_rows

__all__ = ["dequantized", "warn_slow_path", "warn_float_activations"]

_warned: set = set()


def dequantized(w: Tensor, dtype: torch.dtype) -> Tensor:
    """int4 rows [..., K / 32 * 18] as `dtype` [..., K]; a fresh copy each call."""
    return dequantize_int4_rows(w).to(dtype)


def warn_slow_path(op: str) -> None:
    """Say once per process that `op` runs int4 weights in torch, dequantizing each call."""
    if op in _warned:
        return
    _warned.add(op)
    warnings.warn(f"moebench: SLOW PATH: {op} runs int4 weights in torch, dequantizing them to float32 on every "
                  "call (no C++ int4 kernel streams them here); speeds measured this way are not int4's",
                  RuntimeWarning, stacklevel=3)


def warn_float_activations(op: str, ext, weights: str = "int4") -> None:
    """Say once per process and op that `op` ran `weights` (int4, or int8 rows) in torch with float32
    activations while the activations override asks for q8 (kernels/csrc/q8_cpu.h; `ext`: the loaded extension, which
    holds that setting, or None): only the C++ dense and fused MoE kernels quantize activations, so
    here the switch does not act (prefill rows of the dense projections, the slow path)."""
    if ext is None or not hasattr(ext, "activations") or ext.activations() != "q8" or ("q8", op, weights) in _warned:
        return
    _warned.add(("q8", op, weights))
    warnings.warn(f"moebench: q8 ACTIVATIONS NOT APPLIED: {op} runs {weights} weights in torch with float32 activations "
                  "(only the C++ kernels quantize them; docs/int4.md)", RuntimeWarning, stacklevel=3)
