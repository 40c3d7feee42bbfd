"""Per-request state of a hybrid model (Ling-3.0 / `bailing_hybrid`), behind the same cache and
scheduler interfaces as the paged KV cache.

Two kinds of state:
- MLA layers keep a compressed latent per token (the normalised KV latent and the rotated shared
  key, kv_lora_rank + qk_rope_head_dim numbers): paged exactly like K/V, in the blocks the
  `BlockManager` hands out, at the slots `ForwardBatch.slot_mapping` names.
- KDA (linear-attention) layers keep, per request, a recurrent state [heads, key dim, value dim]
  and the last kernel-1 inputs of their short convolutions: a fixed size, whatever the sequence
  length. These live in a pool of state slots.

`StateBlockManager` is a `BlockManager` that also hands each sequence a state slot when its block
table gets its first block, and takes it back when the table is freed (finish, abort, preemption).
Schedulers only ever call the block manager, so static and continuous batching, preemption and
readmission work unchanged: the slot is found again from the sequence's first block, and a
sequence whose prefill starts at token 0 starts from a zero state (a preempted request is
recomputed from its prompt, as its KV would be)."""

from __future__ import annotations

import heapq

import torch

from moebench.engine import memory
from moebench.engine.kv_cache import BlockManager, OutOfBlocks


class StateBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        super().__init__(num_blocks, block_size)
        self.num_state_slots = num_state_slots
        # lowest free slot first: the resident requests' slots stay packed at the pool's start, so a
        # decode batch's states are mostly runs of adjacent rows (updated in place, see slot_runs)
        self.free_state_slots: list[int] = list(range(num_state_slots))  # a heap
        # first block of a sequence's table -> its state slot (-1: none); a tensor so that a step
        # looks every sequence's slot up in one indexing op
        self.state_slot_of_block = torch.full((num_blocks,), -1, dtype=torch.int64)
        self.peak_state_slots = 0

    def can_fit(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        if not block_table and not self.free_state_slots:
            return False
        return super().can_fit(block_table, num_tokens, reserve)

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> None:
        starting = not block_table and self.missing_blocks(block_table, num_tokens) > 0
        if starting and not self.free_state_slots:
            raise OutOfBlocks(f"no free recurrent-state slot ({self.num_state_slots} in use)")
        super().ensure_capacity(block_table, num_tokens)
        if starting:
            self.state_slot_of_block[block_table[0]] = heapq.heappop(self.free_state_slots)
            self.peak_state_slots = max(self.peak_state_slots, self.num_state_slots - len(self.free_state_slots))

    def free(self, block_table: list[int]) -> None:
        first = block_table[0] if block_table else None
        super().free(block_table)  # raises on a double free before any slot is touched
        if first is not None:
            slot = int(self.state_slot_of_block[first])
            self.state_slot_of_block[first] = -1
            if slot >= 0:
                heapq.heappush(self.free_state_slots, slot)

    def state_slots(self, first_blocks: torch.Tensor) -> torch.Tensor:
        """State slot of each sequence, from its first block ([B] block ids)."""
        slots = self.state_slot_of_block[first_blocks.cpu()]
        if bool((slots < 0).any()):
            raise RuntimeError("a sequence in the step has no recurrent-state slot (its blocks were not "
                               "allocated through this block manager)")
        return slots.to(first_blocks.device)


class HybridCache:
    """Latent KV pools of the MLA layers (paged) and state pools of the KDA layers (one row per slot).

    latent[layer]: [num_blocks * block_size, latent_dim]
    recurrent[layer]: [num_state_slots, heads, key_dim, value_dim] (float32: the recurrence
        accumulates over the whole sequence, as the reference keeps it)
    conv[layer]: [num_state_slots, conv_channels, kernel - 1]"""

    def __init__(self, block_manager: StateBlockManager, mla_layers, kda_layers, latent_dim: int,
                 kda_heads: int, kda_head_dim: int, conv_kernel: int, dtype: torch.dtype, device: str):
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.num_blocks = block_manager.num_blocks
        tokens = block_manager.num_blocks * block_manager.block_size
        self.latent = {i: memory.empty((tokens, latent_dim), dtype, device).zero_() for i in mla_layers}
        slots = block_manager.num_state_slots
        self.recurrent = {i: torch.zeros(slots, kda_heads, kda_head_dim, kda_head_dim, dtype=torch.float32,
                                         device=device) for i in kda_layers}
        self.conv = {i: torch.zeros(slots, 3 * kda_heads * kda_head_dim, conv_kernel - 1, dtype=dtype,
                                    device=device) for i in kda_layers}

    def gather_latent(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """Latents of `blocks` ([B, max_blocks]) as [B, max_blocks * block_size, latent_dim], whole
        blocks at a time."""
        pool = self.latent[layer]
        row = self.block_size * pool.shape[1]
        flat = torch.index_select(pool.view(-1, row), 0, blocks.reshape(-1))
        return flat.view(blocks.shape[0], blocks.shape[1] * self.block_size, pool.shape[1])

    def state_bytes_per_request(self) -> int:
        """Bytes of KDA state one request holds, constant in its length."""
        total = 0
        for pool in list(self.recurrent.values()) + list(self.conv.values()):
            total += pool[0].numel() * pool.element_size()
        return total

    def latent_bytes_per_token(self) -> int:
        return sum(p.shape[1] * p.element_size() for p in self.latent.values())
