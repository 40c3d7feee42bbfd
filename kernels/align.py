"""Sorting (token, top-k slot) pairs by expert, and padding each expert's run to a block size.

A fused MoE kernel wants each expert's tokens next to each other so that one pass over the
expert's weights serves all of them. Two views of the same sort:

- `sort_by_expert`: the pairs in expert order plus offsets per expert (CPU paths, grouped mm).
- `moe_align_block_size`: the same order with every expert's run padded to a multiple of the
  GEMM's BLOCK_M, so that each row block of the Triton grouped GEMM belongs to exactly one
  expert and reads one expert's weights. Padding entries hold the sentinel `N * k` (one past
  the last pair), which the kernel masks out.

Plain PyTorch with no host synchronisation: the output sizes are upper bounds computed from
the shapes alone, and the true padded length stays on the device for the kernel to read.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sort_by_expert", "moe_align_block_size", "max_padded_pairs"]


def sort_by_expert(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Returns (order [N*k] int64: pair ids (token * k + slot) grouped by expert, tokens in
    order within an expert; offsets [E+1] int64: expert e owns order[offsets[e]:offsets[e+1]])."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order, offsets


def max_padded_pairs(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Upper bound on the padded length: at most min(E, pairs) experts are non-empty and each
    wastes at most block_size - 1 entries; rounded up to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return -(-bound // block_size) * block_size


def moe_align_block_size(topk_ids: Tensor, block_size: int, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Block-aligned sort of the pairs by expert.

    Returns
      sorted_ids [L] int32: pair ids grouped by expert, each expert's run padded with the
          sentinel N*k up to a multiple of block_size; L = max_padded_pairs(...) (entries past
          the true padded length are sentinels too);
      expert_ids [L // block_size] int32: the expert of each block (blocks past the end get
          the last expert id; the kernel skips them);
      num_padded [1] int32: the true padded length (sum of the padded runs).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    length = max_padded_pairs(pairs, num_experts, block_size)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(pairs, device=device) - count_start[expert_of_sorted]
    sorted_ids = torch.full((length,), pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of_sorted] + rank] = order.to(torch.int32)

    block_start = torch.arange(0, length, block_size, device=device)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    num_padded = padded_end[-1:].to(torch.int32) if num_experts else torch.zeros(1, dtype=torch.int32, device=device)
    return sorted_ids, expert_ids.to(torch.int32), num_padded
