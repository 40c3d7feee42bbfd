"""Triton fused MoE for GPUs: two grouped GEMMs over block-aligned, expert-sorted tokens.

    pairs (token, slot) --moe_align_block_size--> sorted_ids, one expert per BLOCK_M rows
    GEMM 1 (gated):  h[pair]  = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T)     [P, I]
    GEMM 2 (routed): y[pair]  = weight[pair] * (h[pair] @ w2[e].T)                     [P, H]
    top-k reduction: out[token] = sum over the token's k pairs of y                   [N, H]

One kernel serves both GEMMs. Each program computes a BLOCK_M x BLOCK_N tile of C for one
row block (all rows of one expert, read through `sorted_ids`) and streams BLOCK_K slices of
that expert's weight. In gated mode the program holds two accumulators, the gate columns
[n, n+BLOCK_N) and the matching up columns [I+n, I+n+BLOCK_N), so gate and up never go
to memory: the epilogue writes SiLU(gate) * up. In routed mode the epilogue multiplies by
the pair's routing weight. Rows of C are indexed by pair id, so the top-k reduction is a sum
over a [N, k, H] view.

Block sizes come from tuned JSON configs (see tuning.py); tests run this file under
TRITON_INTERPRET=1 on CPU tensors. Kernels are defined at import time, so set that variable
before importing this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .align import moe_align_block_size
from .tuning import get_config

__all__ = ["fused_moe_triton", "invoke_moe_gemm"]


@triton.jit
def moe_gemm_kernel(
    a_ptr,  # [rows of A, K]: x (rows = tokens) or h (rows = pairs)
    b_ptr,  # [E, N_total, K]: w13 (N_total = 2 * N, gated) or w2
    c_ptr,  # [P, N]
    topk_weights_ptr,  # [P] routing weight of each pair
    sorted_ids_ptr,  # [L] pair ids, expert runs padded with P
    expert_ids_ptr,  # [L // BLOCK_M]
    num_padded_ptr,  # [1] true padded length
    N,
    K,
    num_pairs,
    top_k,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROWS_ARE_PAIRS: tl.constexpr,  # False: row of A = pair // top_k (the token)
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32, "tf32" allowed for speed
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    # Grouped ordering of the tiles: GROUP_SIZE_M row blocks sweep the N tiles together, so an
    # expert's weight tiles are re-read from L2 rather than from memory by neighbouring blocks.
    pid = tl.program_id(0)
    num_blocks_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_SIZE_M)
    num_blocks_n = tl.cdiv(N, BLOCK_SIZE_N)
    per_group = GROUP_SIZE_M * num_blocks_n
    group = pid // per_group
    first_m = group * GROUP_SIZE_M
    group_size_m = tl.minimum(num_blocks_m - first_m, GROUP_SIZE_M)
    if group_size_m <= 0:
        return  # the grid is sized for the worst-case padding; this tile is past the end
    pid_m = first_m + (pid % per_group) % group_size_m
    pid_n = (pid % per_group) // group_size_m

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    if A_ROWS_ARE_PAIRS:
        a_row = pair
    else:
        a_row = pair // top_k
    a_row = tl.where(row_ok, a_row, 0)  # padding rows read row 0 and are never stored
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_ok = offs_k < K - k0 * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            # Up rows start N rows below the gate rows in the same expert matrix.
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # SiLU(gate) * up, in float32
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def invoke_moe_gemm(
    a: Tensor,
    b: Tensor,
    c: Tensor,
    topk_weights: Tensor,
    sorted_ids: Tensor,
    expert_ids: Tensor,
    num_padded: Tensor,
    top_k: int,
    n: int,
    *,
    a_rows_are_pairs: bool,
    gated: bool,
    mul_routed_weight: bool,
    config: dict,
) -> None:
    """Launch one grouped GEMM; c [P, n] is written for every real pair."""
    k_dim = a.shape[1]
    bm, bn = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"]
    blocks_m = sorted_ids.numel() // bm
    grid = (blocks_m * triton.cdiv(n, bn),)
    moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_padded,
        n, k_dim, c.shape[0], top_k,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        A_ROWS_ARE_PAIRS=a_rows_are_pairs,
        GATED=gated,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_SIZE_M=bm,
        BLOCK_SIZE_N=bn,
        BLOCK_SIZE_K=config["BLOCK_SIZE_K"],
        GROUP_SIZE_M=config.get("GROUP_SIZE_M", 1),
        num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 2),
    )


def fused_moe_triton(
    x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor, config: dict | None = None
) -> Tensor:
    """Fused SwiGLU MoE with Triton. x [N, H]; topk_weights/topk_ids [N, k]; w13 [E, 2I, H];
    w2 [E, H, I]. Intermediates are kept in x.dtype, accumulation in float32.
    `config`: BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages; default: the tuned config
    for this shape, dtype and device, or a heuristic one."""
    n, k = topk_ids.shape
    e, two_i, h_dim = w13.shape
    inter = two_i // 2
    if x.shape[1] != h_dim or w2.shape != (e, h_dim, inter):
        raise ValueError(f"fused_moe_triton: shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if n == 0:
        return torch.zeros_like(x)
    out_dtype = x.dtype
    if x.dtype != w13.dtype:  # tl.dot needs both operands in one dtype: compute in the weights'
        x = x.to(w13.dtype)
    if w2.dtype != w13.dtype:
        raise ValueError(f"fused_moe_triton: w13 is {w13.dtype} but w2 is {w2.dtype}")
    if config is None:
        config = get_config(e, h_dim, inter, x.dtype, x.device, n, k)
    pairs = n * k
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], e)
    weights = topk_weights.reshape(-1).contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    invoke_moe_gemm(
        x, w13, h, weights, sorted_ids, expert_ids, num_padded, k, inter,
        a_rows_are_pairs=False, gated=True, mul_routed_weight=False, config=config,
    )
    y = torch.empty(pairs, h_dim, dtype=x.dtype, device=x.device)
    invoke_moe_gemm(
        h, w2, y, weights, sorted_ids, expert_ids, num_padded, k, h_dim,
        a_rows_are_pairs=True, gated=False, mul_routed_weight=True, config=config,
    )
    # Top-k reduction: each token's k rows are adjacent. Sum in float32 for half dtypes.
    return y.view(n, k, h_dim).sum(dim=1, dtype=torch.float32).to(out_dtype)
