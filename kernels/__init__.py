"""Compute kernels for the MoE layer: plain PyTorch references, a CPU fast path, Triton on GPU.

The engine calls only the functions exported here:

- `moe_reference(x, topk_weights, topk_ids, w13, w2)`: the per-expert loop (`kernel=naive`).
- `fused_moe(x, topk_weights, topk_ids, w13, w2)`: the fused kernel (`kernel=fused`), Triton on
  CUDA tensors, the C++ (or grouped torch) path on CPU tensors.
- `route(router_logits, top_k, ...)`: softmax or grouped-sigmoid top-k routing, Triton on CUDA;
  on CPU the C++ softmax top-k (float32, where the extension is built), else the reference.

These two are the only places that pick an implementation for the MoE op and for the router: the
engine's kernel and every model's router call them.

Weights: w13 [E, 2I, H] holds each expert's gate rows then up rows, w2 [E, H, I]. E is the
number of resident slots the caller passes, not necessarily the model's expert count.
The Triton modules are imported lazily: importing this package never needs a GPU, and tests can
set TRITON_INTERPRET=1 before the kernels are defined.
"""

from __future__ import annotations

from torch import Tensor

from .cpu_moe import cpu_backend, fused_moe_cpu
from .cpu_routing import softmax_topk_cpu
from .reference import moe_reference, route_grouped_sigmoid, route_softmax_topk

BACKEND_TRITON = "triton"  # the name `fused_moe` counts a Triton call under (see fused_moe's `backends`)

__all__ = [
    "fused_moe",
    "fused_moe_cpu",
    "fused_moe_triton",
    "moe_reference",
    "route",
    "route_softmax_topk",
    "route_grouped_sigmoid",
    "cpu_backend",
    "fused_backend",
]


def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
              backends: dict | None = None) -> Tensor:
    """Fused SwiGLU MoE: x [N, H], topk_weights/topk_ids [N, k], w13 [E, 2I, H], w2 [E, H, I] -> [N, H].

    `backends` (a dict), when given, counts the implementation that computed the call: BACKEND_TRITON,
    or on CPU what `fused_moe_cpu` counts (the C++ kernel, the grouped torch fallback, a per-expert
    loop inside it): the activation evidence of kernel=fused."""
    if x.is_cuda:
        from .triton_moe import fused_moe_triton

        if backends is not None:
            backends[BACKEND_TRITON] = backends.get(BACKEND_TRITON, 0) + 1
        return fused_moe_triton(x, topk_weights, topk_ids, w13, w2)
    return fused_moe_cpu(x, topk_weights, topk_ids, w13, w2, backends)


def fused_backend(device: str = "cpu") -> str:
    """Name of the implementation `fused_moe` runs on this device type, for run manifests."""
    return BACKEND_TRITON if str(device).startswith("cuda") else cpu_backend()


def fused_moe_triton(x, topk_weights, topk_ids, w13, w2, config: dict | None = None) -> Tensor:
    """The Triton fused MoE (see triton_moe.py); imported on first use."""
    from .triton_moe import fused_moe_triton as impl

    return impl(x, topk_weights, topk_ids, w13, w2, config)


def route(
    router_logits: Tensor,
    top_k: int,
    renormalize: bool = True,
    *,
    scoring: str = "softmax",
    e_score_correction_bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Top-k routing -> (weights [N, k] float32, ids [N, k] int64).

    scoring="softmax": Qwen3-MoE / Mixtral / OLMoE (`renormalize` = norm_topk_prob).
    scoring="sigmoid": DeepSeek-V3 / Ling grouped routing with correction bias and scaling.
    On CUDA: the reference for softmax scoring, Triton for sigmoid scoring. On CPU, softmax scoring runs the extension's top-k on float32 logits
    (bit-identical to the reference, cpu_routing.py) and the reference elsewhere; sigmoid scoring
    runs the reference (a small part of a CPU step, and exact).
    """
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"route: unknown scoring {scoring!r} (expected softmax or sigmoid)")
    if router_logits.is_cuda:
        from . import routing

        if scoring == "softmax":  # the reference, as the engine always ran it on CUDA: the Triton top-k
            # (routing.softmax_topk_triton) is checked only under the interpreter here, not on a GPU
            return route_softmax_topk(router_logits, top_k, renormalize)
        return routing.grouped_sigmoid_triton(
            router_logits, e_score_correction_bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor
        )
    if scoring == "softmax":
        return softmax_topk_cpu(router_logits, top_k, renormalize)
    return route_grouped_sigmoid(
        router_logits, e_score_correction_bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor
    )
