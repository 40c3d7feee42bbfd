"""Triton routing kernels: softmax top-k and grouped-sigmoid top-k, one program per token.

Routing is a handful of tiny ops in PyTorch (softmax, topk, gather, division, for grouped
routing a view, another topk and a mask); on a GPU at decode batch sizes each op is a launch
that costs more than its arithmetic. These kernels do it all in registers in one launch.

Top-k is k rounds of "max, then the lowest index holding it, then mark it taken", which
gives the reference's tie rule (equal scores: the lower index wins) exactly. The reference
implementations live in reference.py; `moebench.kernels.route` falls back to them off-GPU.
Kernels are defined at import time: set TRITON_INTERPRET=1 before importing to run on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["softmax_topk_triton", "grouped_sigmoid_triton"]


@triton.jit
def softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_row,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=0)

    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
    taken = offs >= num_experts  # padding lanes can never be chosen
    for j in tl.static_range(TOP_K):
        cand = tl.where(taken, -1.0, p)  # probabilities are >= 0, so -1 is below every real one
        best = tl.max(cand, axis=0)
        idx = tl.min(tl.where(cand == best, offs, BLOCK_E), axis=0)
        taken = taken | (offs == idx)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, idx.to(tl.int64), top_i)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    out = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=out)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=out)


@triton.jit
def grouped_sigmoid_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_row,
    scaling,
    TOP_K: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    LIMIT_GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Scores as a [group, expert-in-group] tile: expert id = group * GROUP_SIZE + column.
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    col = tl.arange(0, BLOCK_S)
    valid = (g[:, None] < N_GROUP) & (col[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + col[None, :]
    logits = tl.load(logits_ptr + row * stride_row + expert, mask=valid, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    biased = scores
    if HAS_BIAS:
        biased = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    neg_inf = float("-inf")
    biased = tl.where(valid, biased, neg_inf)

    if LIMIT_GROUPS:
        # Group score: sum of its two best biased scores (the second may equal the first).
        best1 = tl.max(biased, axis=1)
        first = tl.min(tl.where(biased == best1[:, None], col[None, :], BLOCK_S), axis=1)
        if GROUP_SIZE >= 2:
            best2 = tl.max(tl.where(col[None, :] == first[:, None], neg_inf, biased), axis=1)
            group_score = best1 + best2
        else:
            group_score = best1
        group_taken = g >= N_GROUP
        keep = g < 0  # all False
        for t in tl.static_range(TOPK_GROUP):
            cand = tl.where(group_taken, neg_inf, group_score)
            top = tl.max(cand, axis=0)
            sel = tl.min(tl.where((cand == top) & (~group_taken), g, BLOCK_G), axis=0)
            group_taken = group_taken | (g == sel)
            keep = keep | (g == sel)
        biased = tl.where(keep[:, None], biased, neg_inf)

    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
    taken = ~valid
    if LIMIT_GROUPS:
        taken = taken | (~keep[:, None])
    big = N_GROUP * GROUP_SIZE
    for j in tl.static_range(TOP_K):
        cand = tl.where(taken, neg_inf, biased)
        top = tl.max(tl.max(cand, axis=1), axis=0)
        hit = (cand == top) & (~taken)
        idx = tl.min(tl.min(tl.where(hit, expert, big), axis=1), axis=0)
        chosen = expert == idx
        taken = taken | chosen
        w = tl.sum(tl.sum(tl.where(chosen, scores, 0.0), axis=1), axis=0)  # the unbiased score
        top_w = tl.where(slots == j, w, top_w)
        top_i = tl.where(slots == j, idx.to(tl.int64), top_i)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    top_w = top_w * scaling
    out = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=out)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=out)


def softmax_topk_triton(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Triton version of reference.route_softmax_topk."""
    n, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"softmax_topk: top_k={top_k} with {e} experts")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n:
        softmax_topk_kernel[(n,)](
            logits, weights, ids, e, logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
        )
    return weights, ids


def grouped_sigmoid_triton(
    router_logits: Tensor,
    e_score_correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """Triton version of reference.route_grouped_sigmoid."""
    n, e = router_logits.shape
    n_group = max(1, n_group)
    if e % n_group:
        raise ValueError(f"grouped_sigmoid: {e} experts do not split into {n_group} groups")
    group_size = e // n_group
    limit = n_group > 1 and topk_group < n_group
    if limit and top_k > topk_group * group_size:
        raise ValueError(f"grouped_sigmoid: top_k={top_k} exceeds {topk_group} groups of {group_size}")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = e_score_correction_bias
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n:
        grouped_sigmoid_kernel[(n,)](
            logits, bias.contiguous() if bias is not None else logits, weights, ids,
            logits.stride(0), float(routed_scaling_factor),
            TOP_K=top_k, N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group if limit else n_group,
            LIMIT_GROUPS=limit, HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
            BLOCK_G=triton.next_power_of_2(n_group), BLOCK_S=triton.next_power_of_2(group_size),
            BLOCK_K=triton.next_power_of_2(top_k),
        )
    return weights, ids
