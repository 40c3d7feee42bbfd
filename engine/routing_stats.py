"""Per-step routing statistics: distinct experts and load imbalance per layer, cumulative load."""

from __future__ import annotations

import torch


class RoutingStats:
    def __init__(self, num_layers: int, num_experts: int):
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.long)  # tokens routed, whole run
        self._distinct: list[int] = []
        self._imbalance: list[float] = []
        self.step_experts: dict[int, torch.Tensor] = {}  # layer -> distinct expert ids of this step
        # layer -> [tokens, top_k] expert ids of the latest forward, in batch token order. Not cleared
        # by take_step: the scheduler reads it when planning the next step (affinity admission).
        self.last_topk: dict[int, torch.Tensor] = {}

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        counts = torch.bincount(topk_ids.flatten().cpu(), minlength=self.load.shape[1])
        self.load[layer] += counts
        active = counts[counts > 0]
        self._distinct.append(int(active.numel()))
        self._imbalance.append(float(active.max()) / float(active.float().mean()))
        self.step_experts[layer] = torch.nonzero(counts).flatten()
        self.last_topk[layer] = topk_ids

    def take_step(self) -> dict:
        """Step summary, then reset the per-step accumulators."""
        n = len(self._distinct)
        out = {
            "distinct_experts": sum(self._distinct) / n if n else 0.0,
            "expert_imbalance": sum(self._imbalance) / n if n else 0.0,
        }
        self._distinct.clear()
        self._imbalance.clear()
        self.step_experts = {}
        return out
