"""CPU softmax routing: the extension's top-k (csrc/routing_cpu.cpp) where it is built, else the reference.

The top-k of a softmax router is a handful of small torch ops (softmax, a stable sort, a gather, a
division); the extension's `route_topk` does the top-k and the renormalization in one call after
torch's own softmax, and is bit-identical to `reference.route_softmax_topk` (its renormalization
sums in the order torch's sum takes for the shape, or leaves the division to torch where no order
reproduces it; tests/kernels/test_step_ops.py). Where the extension is not built, `load_extension` has
already warned, and the reference runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cpu_moe import load_extension
from .reference import route_softmax_topk

__all__ = ["softmax_topk_cpu"]


def softmax_topk_cpu(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """route_softmax_topk on CPU logits [N, E]: (weights [N, k] float32, ids [N, k] int64)."""
    ext = load_extension() if router_logits.dtype == torch.float32 else None
    if ext is None or not hasattr(ext, "route_topk"):
        return route_softmax_topk(router_logits, top_k, renormalize)
    return ext.route_topk(torch.softmax(router_logits, dim=-1), top_k, renormalize)
