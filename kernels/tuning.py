"""Block-size configs for the Triton fused MoE: lookup of tuned JSON files (the tuner that writes
them is kernels/triton_tune.py).

A config file lives in `configs/` and is named after what the best block sizes depend on:

    E=128,H=2048,I=768,dtype=bfloat16,device=NVIDIA_H200.json

It maps a token count (as a string) to a config dict:

    {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
           "num_warps": 4, "num_stages": 3}, "64": {...}, ...}

A call with M tokens uses the entry whose key is nearest to M. E is the number of experts in
the weight tensors the kernel sees (an expert store's slot pool may be smaller than the
model's expert count); when no file has that E, one with the same H, I, dtype and device and
the nearest E is used, else the heuristic default. `moebench kernels tune` writes files here.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

__all__ = ["CONFIG_DIR", "config_file_name", "device_key", "get_config", "default_config", "load_configs"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_NAME = re.compile(r"^E=(\d+),H=(\d+),I=(\d+),dtype=([a-z0-9]+),device=(.+)\.json$")


def device_key(device) -> str:
    """The GPU's name with spaces as underscores (configs are per GPU model)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_")


def dtype_key(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(experts: int, hidden: int, inter: int, dtype, device_name: str) -> str:
    return f"E={experts},H={hidden},I={inter},dtype={dtype_key(dtype)},device={device_name}.json"


@functools.lru_cache(maxsize=64)
def load_configs(experts: int, hidden: int, inter: int, dtype_name: str, device_name: str) -> dict[int, dict] | None:
    """Tuned configs {tokens: config} for this shape, or the nearest-E file's, or None."""
    if not CONFIG_DIR.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for path in CONFIG_DIR.glob("*.json"):
        m = _NAME.match(path.name)
        if not m:
            continue
        e, h, i, dt, dev = int(m[1]), int(m[2]), int(m[3]), m[4], m[5]
        if (h, i, dt, dev) != (hidden, inter, dtype_name, device_name):
            continue
        if best is None or abs(e - experts) < best[0]:
            best = (abs(e - experts), path)
    if best is None:
        return None
    data = json.loads(best[1].read_text())
    return {int(key): value for key, value in data.items() if not key.startswith("_")}


def default_config(num_tokens: int, top_k: int, experts: int) -> dict:
    """Heuristic block sizes. Decode sends few rows to each expert, so tall row blocks would be
    mostly padding: use 16 rows until experts average more than 16 rows each."""
    rows_per_expert = num_tokens * top_k / max(experts, 1)
    if rows_per_expert <= 16:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 3}
    if rows_per_expert <= 64:
        return {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                "num_warps": 4, "num_stages": 3}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
            "num_warps": 8, "num_stages": 3}


def get_config(experts: int, hidden: int, inter: int, dtype, device, num_tokens: int, top_k: int) -> dict:
    """The tuned config nearest to num_tokens for this shape/dtype/GPU, else the default."""
    device = torch.device(device)
    if device.type == "cuda":
        table = load_configs(experts, hidden, inter, dtype_key(dtype), device_key(device))
        if table:
            return dict(table[min(table, key=lambda m: abs(m - num_tokens))])
    return default_config(num_tokens, top_k, experts)
