"""Where the MoE block gets expert weights from. The resident store holds every expert in the
fast pool; budgeted stores with an offload tier plug in behind the same `fetch` call."""

from __future__ import annotations

import torch


class ExpertStore:
    def fetch(self, layer: int, topk_ids: torch.Tensor):
        """-> (w13 pool, w2 pool, topk_ids remapped to pool slots)."""
        raise NotImplementedError

    def take_step(self) -> dict:
        return {}

    def evidence(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class ResidentStore(ExpertStore):
    def __init__(self, ckpt):
        self.layers = ckpt.layers

    def fetch(self, layer, topk_ids):
        w = self.layers[layer]
        return w.w13, w.w2, topk_ids


class NoPrefetch:
    name = "off"

    def before_layer(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        pass

    def evidence(self) -> dict:
        return {}


def make_store_and_prefetcher(ckpt, runtime):
    """Build the expert store for the configured budget and the prefetch strategy."""
    from moebench.errors import MoebenchError

    budget = runtime.expert_budget
    if runtime.prefetch == "off" and (budget in (1, 1.0, "1", "1.0")):
        return ResidentStore(ckpt), NoPrefetch()
    raise MoebenchError(
        f"prefetch={runtime.prefetch} with --expert-budget {budget} is not implemented yet "
        "(only the fully resident store with prefetch=off exists)"
    )
