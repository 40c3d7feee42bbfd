"""Plain PyTorch reference implementations: the ground truth every kernel is tested against.

`moe_reference` is also the engine's `kernel=naive` path, so it is written the way Hugging Face
runs an MoE block (a Python loop over experts, gather -> two matmuls -> scatter-add), minus
the needless parts: one sort and one bincount find each expert's tokens, and the loop visits
only experts that received tokens (Hugging Face builds a one-hot mask over all experts and
scans it per expert). The optimization it is the baseline for is fusion, not this bookkeeping.

Tie rule for routing: when scores are equal, the lower index wins (experts and groups alike).
`torch.topk` does not promise any order among equal values, so selection goes through a stable
descending sort; the Triton routing kernels follow the same rule and are tested on ties.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["route_softmax_topk", "route_grouped_sigmoid", "moe_reference", "topk_lowest_index", "lm_head_reference",
           "unpack_int8_rows", "rows_linear_reference", "unpack_int4_rows", "dequantize_int4_rows",
           "stored_width", "stored_columns", "quantize_q8_rows", "q4_q8_dot_reference", "i8_q8_dot_reference", "q8_dot_reference",
           "q8_linear_reference",
           "moe_q8_reference"]


def topk_lowest_index(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last dimension, descending, ties broken by the lower index."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def route_softmax_topk(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Softmax router (Qwen3-MoE, Mixtral, OLMoE): softmax over all experts in float32, top-k.

    With `renormalize` (Qwen3-MoE's `norm_topk_prob=True`, Mixtral) the k weights are divided by
    their sum. Returns (weights [N, k] float32, ids [N, k] int64).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = topk_lowest_index(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped_sigmoid(
    router_logits: Tensor,
    e_score_correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 / Ling (bailing) router: sigmoid scores with group-limited top-k.

    The correction bias is added to the scores only to choose experts. Experts are split into
    `n_group` equal groups; each group is ranked by the sum of its two best biased scores, the
    best `topk_group` groups are kept, and the top-k experts are chosen among them. The weights
    are the unbiased sigmoid scores of the chosen experts, divided by their sum when
    `renormalize`, then multiplied by `routed_scaling_factor`.

    Experts outside the kept groups are masked with -inf (not 0, as some implementations do):
    biased scores can be negative, and a masked expert must never be chosen.
    """
    n, e = router_logits.shape
    scores = torch.sigmoid(router_logits.float())
    biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if n_group > 1 and topk_group < n_group:
        if e % n_group:
            raise ValueError(f"route_grouped_sigmoid: {e} experts do not split into {n_group} groups")
        grouped = biased.view(n, n_group, e // n_group)
        best2 = topk_lowest_index(grouped, min(2, e // n_group))[0]
        group_scores = best2.sum(dim=-1)
        _, group_ids = topk_lowest_index(group_scores, topk_group)
        keep = torch.zeros(n, n_group, dtype=torch.bool, device=router_logits.device)
        keep.scatter_(1, group_ids, True)
        keep = keep.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
        biased = biased.masked_fill(~keep, float("-inf"))
    _, ids = topk_lowest_index(biased, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def moe_reference(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """SwiGLU mixture of experts, one expert at a time (the `kernel=naive` baseline).

    x [N, H]; topk_weights, topk_ids [N, k]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I].
    `E` is whatever the weight tensors hold (a pool of resident slots is fine); ids index it.
    For each expert that received tokens: gather them, h = silu(x @ gate.T) * (x @ up.T),
    y = h @ w2.T, scaled by the routing weight; each token's k results are then added in rank
    order, in x.dtype. (Not in expert order: ids may name pool slots, and a sum in slot order would
    round differently from one pool layout to the next when k > 2.)
    """
    n, k = topk_ids.shape
    inter = w13.shape[1] // 2
    if n == 0:
        return torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync
    token_of = order // k
    weight_of = topk_weights.reshape(-1)[order].to(x.dtype)
    pairs = x.new_empty(n * k, x.shape[1])  # row t * k + rank: that pair's weighted output
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        xs = x[tokens]
        w = w13[expert]
        h = F.silu(rows_linear_reference(xs, w[:inter])) * rows_linear_reference(xs, w[inter:])
        pairs[order[start : start + count]] = rows_linear_reference(h, w2[expert]) * weight_of[start : start + count, None]
        start += count
    pairs = pairs.view(n, k, -1)
    out = pairs[:, 0].clone()
    for rank in range(1, k):
        out += pairs[:, rank]
    return out


def lm_head_reference(x: Tensor, w: Tensor, scale: Tensor | None = None) -> Tensor:
    """Logits [N, vocab] float32 of an LM head stored in low precision: x @ w.T with w upcast to float32
    (exact for bfloat16, int8 and fp8 e4m3), then each column times its row's scale where there is
    one, in that order, as the kernel (kernels/cpu_dense.lm_head) computes it: a row's dot product with
    the stored values, then its scale. One matmul on the upcast weight (a float32 copy of the head
    for the duration of the call)."""
    out = x.float() @ w.float().T
    return out * scale.float() if scale is not None else out


# int8 rows that carry their scale (--weights int8; engine/quantize.py: pack_int8_rows, read by
# kernels/csrc/cpu_common.h): each row is its K int8 values, its float32 scale, 4 bytes of padding.
PACKED_EXTRA = 8


def unpack_int8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """(values int8 [..., K], scale float32 [...]) of int8 rows that carry their scale [..., K + 8]."""
    k = w.shape[-1] - PACKED_EXTRA
    return w[..., :k], w[..., k:k + 4].contiguous().view(torch.float32)[..., 0]


# int4 rows (--weights int4; engine/quantize.py: pack_int4_rows, docs/int4.md), held as uint8: each row
# is K / 32 blocks of llama.cpp's Q4_0, byte for byte: a float16 scale d, then 16 bytes whose low
# nibbles are the block's values 0-15 and high nibbles its values 16-31, each stored as q + 8 (q in
# [-8, 7]); the value is q * d. The same bytes are what `moebench export gguf --dtype q4_0` writes.
INT4_GROUP = 32
INT4_GROUP_BYTES = 18


def stored_width(k: int, dtype: torch.dtype) -> int:
    """The last dimension of a matrix of K input columns as the runtime stores it in `dtype`: int8 rows
    carry their scale (K + 8), int4 rows are K / 32 blocks of 18 bytes, float rows are K wide."""
    if dtype == torch.int8:
        return k + PACKED_EXTRA
    if dtype == torch.uint8:
        return k // INT4_GROUP * INT4_GROUP_BYTES
    return k


def stored_columns(width: int, dtype: torch.dtype) -> int:
    """The input width K of a matrix whose stored rows are `width` wide in `dtype` (stored_width's inverse)."""
    if dtype == torch.int8:
        return width - PACKED_EXTRA
    if dtype == torch.uint8:
        return width // INT4_GROUP_BYTES * INT4_GROUP
    return width


def unpack_int4_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """(values int8 [..., K] in [-8, 7], scales float32 [..., K / 32]) of int4 rows [..., K / 32 * 18]."""
    *lead, width = w.shape
    blocks = w.reshape(*lead, width // INT4_GROUP_BYTES, INT4_GROUP_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16)[..., 0].float()
    nibbles = blocks[..., 2:]
    values = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.int8) - 8
    return values.reshape(*lead, -1), scale


def dequantize_int4_rows(w: Tensor) -> Tensor:
    """float32 [..., K]: each value times its block's scale (exact in float32: a 4-bit integer times a
    float16)."""
    values, scale = unpack_int4_rows(w)
    *lead, k = values.shape
    return (values.float().reshape(*lead, k // INT4_GROUP, INT4_GROUP) * scale[..., None]).reshape(*lead, k)


def rows_linear_reference(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T in x's dtype for a float weight (a bfloat16 one widened exactly first); for int8 rows
    with their scales, x @ values.T times each row's scale, in that order, as the kernels compute it
    (lm_head_reference); for int4 rows, x @ dequantized.T in float32 (the dequantized weight is exact,
    so a kernel differs from it only in the order of its float32 sums)."""
    if w.dtype == torch.int8:
        values, scale = unpack_int8_rows(w)
        return lm_head_reference(x, values, scale).to(x.dtype)
    if w.dtype == torch.uint8:
        return (x.float() @ dequantize_int4_rows(w).T).to(x.dtype)
    return x @ w.to(x.dtype).T


# Activations quantized per block of 32 values (the activations override q8, kernels/csrc/q8_cpu.h,
# docs/int4.md): an approximation, as llama.cpp's Q8_0 activations of its Q4_0 dot products. The kernels
# compute exactly what these functions compute, float32 operation for float32 operation.
Q8_GROUP = 32


def quantize_q8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """(q int8 [..., K], d float32 [..., K / 32]) of float32 rows x [..., K] (K a multiple of 32): per
    block, amax = max |x|, d = amax / 127, q = x * (127 / amax) rounded half to even (0 where amax is 0),
    as ggml's AVX2 quantize_row_q8_0, but d kept in float32 (ggml rounds it to float16)."""
    *lead, k = x.shape
    blocks = x.float().reshape(*lead, k // Q8_GROUP, Q8_GROUP)
    amax = blocks.abs().amax(dim=-1)
    d = amax / 127
    inv = torch.where(amax != 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.reshape(*lead, k), d


def _blockwise_q8(q: Tensor, d: Tensor, values: Tensor, dw: Tensor | None = None) -> Tensor:
    """[N, M] float32: per block of 32 in order, the exact integer sum i of tokens q [N, K] with rows
    values [M, K], then acc = acc + float(i) * scale, scale d_x (or d_w * d_x where the rows have block
    scales dw [M, K / 32]), each operation rounded on its own."""
    n, k = q.shape
    m = values.shape[0]
    blocks = k // Q8_GROUP
    wb = values.to(torch.int32).reshape(1, m, blocks, Q8_GROUP)
    xb = q.to(torch.int32).reshape(n, 1, blocks, Q8_GROUP)
    acc = torch.zeros(n, m, dtype=torch.float32)
    for b in range(blocks):
        isum = (wb[:, :, b] * xb[:, :, b]).sum(dim=-1)  # [N, M], exact
        scale = d[:, None, b] if dw is None else dw[None, :, b] * d[:, None, b]
        acc = acc + isum.float() * scale
    return acc


def q4_q8_dot_reference(q: Tensor, d: Tensor, w: Tensor) -> Tensor:
    """[N, M] float32: quantized tokens (q [N, K] int8, d [N, K / 32], quantize_q8_rows) dotted with int4
    rows w [M, K / 32 * 18] as the kernel sums them (kernels/csrc/q8_cpu.h: q4q8_dot8): per block in
    order, its exact integer sum i, then acc = acc + float(i) * (d_w * d_x), each operation rounded on
    its own; ggml's scalar vec_dot_q4_0_q8_0 order."""
    values, dw = unpack_int4_rows(w)  # [M, K] int8 in [-8, 7], [M, K / 32]
    return _blockwise_q8(q, d, values, dw)


def i8_q8_dot_reference(q: Tensor, d: Tensor, values: Tensor, scale: Tensor) -> Tensor:
    """[N, M] float32: quantized tokens (quantize_q8_rows) dotted with int8 rows (values [M, K], scale
    [M] float32) as the kernel sums them (kernels/csrc/q8_cpu.h: i8q8_dot8): per block in order, its
    exact integer sum i, then acc = acc + float(i) * d_x, each operation rounded on its own; then the
    row's scale, as the weight-only int8 kernels apply it."""
    return _blockwise_q8(q, d, values) * scale.float()[None, :]


def q8_dot_reference(q: Tensor, d: Tensor, w: Tensor, scale: Tensor | None = None) -> Tensor:
    """[N, M] float32: quantized tokens dotted with int4 rows (uint8, Q4_0 blocks), int8 rows that carry
    their scale, or int8 rows with a separate `scale` (an LM head), as the q8 kernels sum them."""
    if w.dtype == torch.uint8:
        return q4_q8_dot_reference(q, d, w)
    values, row_scale = unpack_int8_rows(w) if scale is None else (w, scale)
    return i8_q8_dot_reference(q, d, values, row_scale)


def q8_linear_reference(x: Tensor, w: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """x [N, K] float32 @ int4 or int8 rows w.T with x quantized per block (the dense kernel and the LM
    head with q8 activations), plus the bias after the dot (and the scale)."""
    out = q8_dot_reference(*quantize_q8_rows(x), w, scale)
    return out + bias.float() if bias is not None else out


def moe_q8_reference(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The fused MoE kernel with int4 experts (or int8 experts with their row scales) and q8 activations:
    each token quantized once, each (token, rank) pair's silu(gate) * up row quantized once, the dots as
    q8_dot_reference, the routed weight times each down row, and each token's k rows added in rank order
    (moe_reference's)."""
    n, k = topk_ids.shape
    inter = w13.shape[1] // 2
    xq, xd = quantize_q8_rows(x)
    pairs = torch.empty(n * k, w2.shape[1], dtype=torch.float32)
    for p in range(n * k):
        t, e = p // k, int(topk_ids.reshape(-1)[p])
        o = q8_dot_reference(xq[t:t + 1], xd[t:t + 1], w13[e])[0]
        h = F.silu(o[:inter]) * o[inter:]
        hq, hd = quantize_q8_rows(h[None])
        pairs[p] = topk_weights.reshape(-1)[p].float() * q8_dot_reference(hq, hd, w2[e])[0]
    pairs = pairs.view(n, k, -1)
    out = pairs[:, 0].clone()
    for rank in range(1, k):
        out += pairs[:, rank]
    return out
