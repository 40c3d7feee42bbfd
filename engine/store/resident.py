"""The resident store: every expert in memory (budget 1.0), every look-up a hit."""

from __future__ import annotations

import torch

from moebench.engine import memory
from moebench.engine.store.tiers import experts_in
from moebench.engine.store.base import EMPTY_STEP, ExpertStore, dtype_name, host_ids, memory_evidence


class ResidentStore(ExpertStore):
    """Every expert in the fast pool: every look-up is a hit, nothing is ever loaded.

    A checkpoint loaded without its experts (`load_checkpoint(..., load_experts=False)`, for the disk
    tier) gets them read from its files into the store's own buffers, which go with the store."""

    def __init__(self, ckpt, budget=1.0, dtype: torch.dtype | None = None):
        self.experts = {i: (w.w13, w.w2) for i, w in enumerate(ckpt.layers) if w.w13 is not None}
        moe = [i for i in range(ckpt.config.num_layers) if ckpt.config.is_moe_layer(i)]
        if moe and not self.experts:
            self.experts = read_all_experts(ckpt, dtype or torch.float32)
        elif dtype is not None and any(w13.dtype != dtype for w13, _ in self.experts.values()):
            # converted once per checkpoint, where the loaded experts are
            self.experts = experts_in(ckpt, dtype, next(iter(self.experts.values()))[0].device)
        self.dtype = dtype
        self.budget = budget
        self.hits = 0  # look-ups this run, every one a hit
        self._step_hits = 0
        self.rss = memory.PeakRss()
        own = [w for pair in self.experts.values() for w in pair]
        ckpt_experts = [w for layer in ckpt.layers for w in (layer.w13, layer.w2) if w is not None]
        self._memory = {"expert_pool_bytes": memory.tensor_bytes(own),
                        "host_copy_bytes": memory.tensor_bytes(ckpt_experts + own) - memory.tensor_bytes(own),
                        "read_buffer_bytes": 0}

    def memory(self) -> dict:
        return memory_evidence(self._memory, self.rss)

    def fetch(self, layer, topk_ids):
        w13, w2 = self.experts[layer]
        self.count_hits(len(set(host_ids(topk_ids).ravel().tolist())))
        return w13, w2, topk_ids

    def count_hits(self, distinct_experts: int) -> None:
        """Look-ups of so many distinct experts, made without `fetch` (a native decode step's layers,
        MoeBlock.ran_natively): all hits."""
        self.hits += distinct_experts
        self._step_hits += distinct_experts

    def take_step(self):
        hits, self._step_hits = self._step_hits, 0
        return {**EMPTY_STEP, "expert_hits": hits}  # it loads nothing, never waits

    def evidence(self):
        return {"store": "resident", "expert_budget": self.budget, "expert_hits": self.hits,
                "expert_dtype": dtype_name(next(iter(self.experts.values()))[0].dtype) if self.experts else None,
                "expert_misses": 0, "hit_rate": 1.0 if self.hits else None, **self.memory()}


def read_all_experts(ckpt, dtype: torch.dtype) -> dict:
    """Every MoE layer's experts read from the checkpoint's files into new stacked buffers."""
    from moebench.engine.store.tiers import DiskTier

    cfg = ckpt.config
    tier = DiskTier(ckpt, readers=1)
    try:
        out = {}
        for i in range(cfg.num_layers):
            if not cfg.is_moe_layer(i):
                continue
            E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
            w13, w2 = memory.empty((E, 2 * I, H), dtype), memory.empty((E, H, I), dtype)
            for e in range(E):
                tier.load(i, e, w13[e], w2[e])
            out[i] = (w13, w2)
        return out
    finally:
        tier.close()
