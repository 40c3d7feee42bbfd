"""Per-step routing statistics: distinct experts and load imbalance per layer, cumulative load."""

from __future__ import annotations

import numpy as np
import torch


class RoutingStats:
    def __init__(self, num_layers: int, num_experts: int):
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.long)  # tokens routed, whole run
        self._load = self.load.numpy()  # the same memory, updated in numpy
        self._step: list[tuple[int, torch.Tensor]] = []  # (layer, topk_ids) of this step, counted at its end
        # layer -> [tokens, top_k] expert ids of the latest forward, in batch token order. Not cleared
        # by take_step: the scheduler reads it when planning the next step (affinity admission).
        self.last_topk: dict[int, torch.Tensor] = {}
        self._ext = None  # the extension's routing summary (False: numpy), looked up on the first step

    def record_layers(self, topk_ids: list[torch.Tensor]) -> None:
        """`record` for layers 0, 1, ... at once (a decode step whose layers ran in one native call)."""
        layers = list(enumerate(topk_ids))
        self._step.extend(layers)
        self.last_topk.update(layers)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._step.append((layer, topk_ids))
        self.last_topk[layer] = topk_ids

    def take_step(self) -> dict:
        """Step summary (mean over the step's MoE calls), then reset. Counted once per step, for all
        layers at once, in the C++ extension (else numpy): a handful of small torch ops per layer
        would cost more than the counting. The means are float32, as torch computes them."""
        if not self._step:
            return {"distinct_experts": 0.0, "expert_imbalance": 0.0}
        if self._ext is None:
            self._ext = _extension() or False
        ext = self._ext
        if ext:  # the same counting and float32 means in one C++ call
            ids = [t if t.device.type == "cpu" else t.cpu() for _, t in self._step]
            distinct_mean, imbalance_mean = ext.routing_step_summary(ids, [layer for layer, _ in self._step], self.load)
            self._step = []
            return {"distinct_experts": distinct_mean, "expert_imbalance": imbalance_mean}
        E = self._load.shape[1]
        rows = len(self._step)
        ids = [t for _, t in self._step]
        sizes = [t.numel() for t in ids]
        if sizes.count(sizes[0]) == rows:  # every MoE call of a step sees the same tokens
            flat = torch.stack(ids).cpu().numpy().reshape(rows, -1)
            flat = flat + (np.arange(rows, dtype=np.int64) * E)[:, None]
        else:
            flat = torch.cat([t.reshape(-1) for t in ids]).cpu().numpy()
            flat = flat + np.repeat(np.arange(rows, dtype=np.int64) * E, sizes)
        # row i's ids counted in bins i * E .. i * E + E - 1
        counts = np.bincount(flat.reshape(-1), minlength=rows * E).reshape(rows, E)
        layers = [layer for layer, _ in self._step]
        if layers == list(range(layers[0], layers[0] + rows)):
            self._load[layers[0] : layers[0] + rows] += counts
        else:
            np.add.at(self._load, layers, counts)
        distinct = (counts > 0).sum(1)
        with np.errstate(divide="ignore", invalid="ignore"):  # an empty call: 0 / 0, as torch gives nan
            # max / mean over active experts; int64 -> float32 division, as torch's true division
            imbalance = (counts.max(1) * distinct).astype(np.float32) / counts.sum(1).astype(np.float32)
        self._step = []
        # the mean of small integers is exact in float32 whatever the order: sum, then one division
        distinct_mean = np.float32(distinct.sum()) / np.float32(rows)
        return {"distinct_experts": float(distinct_mean),
                "expert_imbalance": float(torch.from_numpy(imbalance).mean())}


def _extension():
    """The CPU extension when it is built and has the routing summary, else None (numpy counts)."""
    from moebench.kernels.cpu_moe import load_extension

    ext = load_extension()
    return ext if ext is not None and hasattr(ext, "routing_step_summary") else None
