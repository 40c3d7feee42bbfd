"""What every expert store shares: the interface the MoE block calls, per-step counters and the
memory evidence (engine/store/expert_store.py's pooled stores, engine/store/resident.py's resident one)."""

from __future__ import annotations

import numpy as np
import torch

STEP_KEYS = ("expert_hits", "expert_misses", "prefetch_issued", "prefetch_hits", "bytes_loaded", "stall_s")
# a step in which nothing was looked up, loaded or waited for
EMPTY_STEP = {**dict.fromkeys(STEP_KEYS, 0), "stall_s": 0.0}


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


class Counters:
    """Per-step counters (reset by take_step) plus run totals, both fed by the same `add`."""

    def __init__(self, extra_total_keys=()):
        self.step = dict(EMPTY_STEP)
        self.total = dict(self.step)
        for k in extra_total_keys:
            self.total[k] = 0

    def add(self, key: str, value) -> None:
        if key in self.step:
            self.step[key] += value
        self.total[key] += value

    def take_step(self) -> dict:
        out = self.step
        self.step = dict(EMPTY_STEP)
        return out


def host_ids(ids: torch.Tensor) -> np.ndarray:
    """Expert ids as a numpy array: the store's and the prefetcher's work on a few ids per call is
    done in numpy, whose calls cost ~0.1 us where a small torch call costs ~10 us inside a decode step
    (its code is cold after the layer's kernel)."""
    return ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()


def memory_evidence(parts: dict, rss) -> dict:
    """`expert_memory_bytes`: every expert byte the run holds in memory (fast pool or resident
    experts, any host copy, read buffers); the process's peak RSS since the store was made."""
    return {"expert_memory_bytes": sum(parts.values()), **parts,
            "process_rss_peak_bytes": rss.peak(), "rss_peak_since_process_start": rss.since_start}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of the dtype, but "int4" for uint8: the only uint8 rows held are int4 (Q4_0) blocks
    (--weights int4, kernels/reference.py)."""
    return "int4" if dtype == torch.uint8 else str(dtype).replace("torch.", "")
