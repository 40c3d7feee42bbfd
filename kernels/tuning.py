"""Block-size configs for the Triton fused MoE: lookup of tuned JSON files, and the tuner.

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
import math
import re
import time
from pathlib import Path

import torch

__all__ = ["CONFIG_DIR", "config_file_name", "device_key", "get_config", "default_config", "load_configs", "tune"]

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


def candidate_configs(quick: bool = False) -> list[dict]:
    # The full space is ~430 configs (minutes per token count, mostly compiling); --quick ~24.
    ms = [16, 32, 64] if quick else [16, 32, 64, 128]
    ns = [64, 128] if quick else [64, 128, 256]
    ks = [64, 128] if quick else [64, 128, 256]
    groups = [1] if quick else [1, 16]
    warps = [4] if quick else [4, 8]
    stages = [3] if quick else [2, 3, 4]
    out = []
    for bm in ms:
        for bn in ns:
            for bk in ks:
                for g in groups:
                    for w in warps:
                        for s in stages:
                            out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
                                        "GROUP_SIZE_M": g, "num_warps": w, "num_stages": s})
    return out


def _time_config(fn, repeats: int = 20) -> float:
    """Median milliseconds of fn() with CUDA events (after a warm-up that also compiles)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def tune(
    experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype: str,
    device: str,
    token_counts: list[int],
    out_dir: Path | None = None,
    quick: bool = False,
    log=print,
) -> Path:
    """Time every candidate config for each token count with random routing; write the best
    per token count as a config file and return its path. Needs a CUDA GPU."""
    if not torch.cuda.is_available() or not str(device).startswith("cuda"):
        raise RuntimeError("tuning needs a CUDA GPU")
    from .reference import moe_reference
    from .triton_moe import fused_moe_triton

    dev = torch.device(device)
    dt = getattr(torch, dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dt, generator=gen) * inter**-0.5
    results: dict[str, dict] = {}
    candidates = candidate_configs(quick)
    for m in token_counts:
        x = torch.randn(m, hidden, device=dev, dtype=dt, generator=gen)
        logits = torch.randn(m, experts, device=dev, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        ref = moe_reference(x, weights, ids, w13, w2).float()
        scale = ref.abs().max().item() + 1e-6
        best: tuple[float, dict] | None = None
        started = time.perf_counter()
        # Row blocks much taller than the rows an expert receives are pure padding.
        rows_per_expert = m * top_k / experts
        useful_m = max(16, 1 << max(0, math.ceil(math.log2(max(rows_per_expert, 1)))))
        for cfg in candidates:
            if cfg["BLOCK_SIZE_M"] > 2 * useful_m:
                continue
            try:
                out = fused_moe_triton(x, weights, ids, w13, w2, cfg)
                # A config that compiles but computes garbage (e.g. out of shared memory) is skipped.
                if (out.float() - ref).abs().max().item() > 0.05 * scale:
                    continue
                ms = _time_config(lambda: fused_moe_triton(x, weights, ids, w13, w2, cfg))
            except Exception:  # noqa: BLE001 - resources exceeded, unsupported layout
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is None:
            raise RuntimeError(f"tuning: no config ran for {m} tokens")
        results[str(m)] = best[1]
        log(f"tokens {m}: {best[0] * 1e3:.1f} us with {best[1]} ({time.perf_counter() - started:.0f} s)")
    target = Path(out_dir) if out_dir else CONFIG_DIR
    target.mkdir(parents=True, exist_ok=True)
    path = target / config_file_name(experts, hidden, inter, dt, device_key(dev))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)
    load_configs.cache_clear()
    return path
