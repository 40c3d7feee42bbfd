"""Paged KV cache: a pool of fixed-size blocks per layer, and the block manager that hands them out.

Each sequence owns a block table (list of block ids); token at position p lives in slot
block_table[p // block_size] * block_size + p % block_size. Blocks return to the free list when a
sequence finishes, so memory neither fragments nor grows with the number of requests served.
"""

from __future__ import annotations

from collections import deque

import torch

from moebench.engine import memory


class OutOfBlocks(Exception):
    """Not enough free blocks right now; the scheduler keeps the request waiting."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.allocations = 0
        self.reuses = 0
        self.peak_used = 0
        self._ever_used: set[int] = set()
        # Blocks handed out and not yet returned: freeing one twice would let two sequences write
        # the same slots, which corrupts outputs silently, so it is an error instead.
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks `block_table` lacks to hold `num_tokens` tokens (0 when it already does)."""
        return max(0, self.blocks_needed(num_tokens) - len(block_table))

    def can_fit(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether `block_table` can grow to `num_tokens` tokens and still leave `reserve` blocks free."""
        return self.missing_blocks(block_table, num_tokens) + reserve <= len(self.free_blocks)

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place to hold `num_tokens` tokens, or raise OutOfBlocks untouched."""
        missing = self.missing_blocks(block_table, num_tokens)
        if missing == 0:
            return
        if missing > len(self.free_blocks):
            raise OutOfBlocks(f"need {missing} blocks, {len(self.free_blocks)} free")
        for _ in range(missing):
            block = self.free_blocks.popleft()
            self.allocations += 1
            if block in self._ever_used:
                self.reuses += 1
            self._ever_used.add(block)
            self._in_use.add(block)
            block_table.append(block)
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, block_table: list[int]) -> None:
        stale = [b for b in block_table if b not in self._in_use]
        if stale:
            raise ValueError(f"KV blocks {stale} freed but not in use (double free)")
        self._in_use.difference_update(block_table)
        self.free_blocks.extend(block_table)
        block_table.clear()


class KVCache:
    """Per-layer K and V pools shaped [num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [memory.empty(shape, dtype, device).zero_() for _ in range(num_layers)]
        self.v = [memory.empty(shape, dtype, device).zero_() for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Where a step's gathered context goes, reused by every layer and step: a fresh multi-MB
        # tensor per layer would be faulted in page by page each time (slow in 4 KiB pages).
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` ([B, max_blocks] block ids), as [B, max_blocks * block_size,
        kv_heads, head_dim] views of a reusable buffer, valid until the next call. Whole blocks are
        copied (rows of block_size * kv_heads * head_dim contiguous elements), which is much faster
        than gathering token by token."""
        pool_k, pool_v = self.k[layer], self.v[layer]
        heads, dim = pool_k.shape[1:]
        row = self.block_size * heads * dim
        n = blocks.numel()
        if self._gathered is None or self._gathered[0].shape[0] < n:
            size = max(n, 2 * self._gathered[0].shape[0] if self._gathered else 0)  # grows rarely
            self._gathered = tuple(memory.empty((size, row), pool_k.dtype, pool_k.device) for _ in range(2))
        flat = blocks.reshape(-1)
        shape = (blocks.shape[0], blocks.shape[1] * self.block_size, heads, dim)
        k = torch.index_select(pool_k.view(-1, row), 0, flat, out=self._gathered[0][:n]).view(shape)
        v = torch.index_select(pool_v.view(-1, row), 0, flat, out=self._gathered[1][:n]).view(shape)
        return k, v
