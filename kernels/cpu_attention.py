"""CPU decode attention over the paged KV cache (csrc/attention_cpu.cpp), with its reference.

A decode step's attention on the CPU is a dozen small torch ops per layer (gather the context's
blocks into a padded copy, a mask, SDPA, transposes); the kernel reads each sequence's keys and
values from the pool through its block table once, with a two-pass softmax (matching SDPA to ~1e-6,
not bit for bit). It ships in the same
extension as the fused MoE kernel; where that cannot be built, `paged_decode_attention` returns
None and the caller keeps the torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_moe import load_extension

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "decode_attention_backend"]

def decode_attention_backend(device: str, dtype: torch.dtype, attention: str = "kernel") -> str:
    """Which decode attention a model on `device` in `dtype` runs, for manifests (`attention`: the
    overrides' choice, engine/overrides.py)."""
    usable = attention != "torch" and device == "cpu" and dtype == torch.float32
    return "cpp-paged" if usable and load_extension() is not None else "torch-sdpa"


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, blocks: Tensor, lens: Tensor,
                           block_size: int, scale: float, window: int | None = None) -> Tensor | None:
    """q [B, H, D]; k_pool, v_pool [slots, KVH, D]; blocks [B, max_blocks] block ids; lens [B]
    context lengths (the new token included). -> [B, H, D], or None where the kernel does not
    apply (no extension, not float32 on the CPU)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_pool.dtype != torch.float32:
        return None
    ext = load_extension()
    if ext is None:
        return None
    return ext.paged_decode_attention(q, k_pool, v_pool, blocks, lens, block_size, scale, window or 0)


def paged_decode_attention_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, blocks: Tensor, lens: Tensor,
                                     block_size: int, scale: float, window: int | None = None) -> Tensor:
    """The same in plain torch, one sequence at a time: gather the context token by token, SDPA."""
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        pos = torch.arange(n)
        slots = blocks[b][pos // block_size] * block_size + pos % block_size
        if window:
            slots = slots[max(0, n - window):]
        keys, values = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)  # [KVH, n, D]
        out.append(F.scaled_dot_product_attention(q[b][:, None], keys, values, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)
