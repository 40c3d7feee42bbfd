"""Per-step routing statistics: distinct experts and load imbalance per layer, cumulative load."""

from __future__ import annotations

import torch


class RoutingStats:
    def __init__(self, num_layers: int, num_experts: int):
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.long)  # tokens routed, whole run
        self._step: list[tuple[int, torch.Tensor]] = []  # (layer, topk_ids) of this step, counted at its end
        # layer -> [tokens, top_k] expert ids of the latest forward, in batch token order. Not cleared
        # by take_step: the scheduler reads it when planning the next step (affinity admission).
        self.last_topk: dict[int, torch.Tensor] = {}

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._step.append((layer, topk_ids))
        self.last_topk[layer] = topk_ids

    def take_step(self) -> dict:
        """Step summary (mean over the step's MoE calls), then reset. Counted once per step, for all
        layers at once: a handful of small ops per layer would cost more than the counting."""
        if not self._step:
            return {"distinct_experts": 0.0, "expert_imbalance": 0.0}
        E = self.load.shape[1]
        rows = len(self._step)
        flat = torch.cat([ids.flatten().cpu() + i * E for i, (_, ids) in enumerate(self._step)])
        counts = torch.bincount(flat, minlength=rows * E).view(rows, E)
        self.load.index_add_(0, torch.tensor([layer for layer, _ in self._step]), counts)
        distinct = (counts > 0).sum(1)
        imbalance = counts.max(1).values * distinct / counts.sum(1)  # max / mean over active experts
        self._step = []
        return {"distinct_experts": float(distinct.float().mean()),
                "expert_imbalance": float(imbalance.float().mean())}
