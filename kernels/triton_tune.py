"""The tuner of the Triton fused MoE's block sizes: times every candidate config per token count on
a CUDA GPU and writes the best as a config file that kernels/tuning.py looks up (`moebench kernels
tune`). It sits above the kernel it times, which imports only the lookup."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .reference import moe_reference
from .triton_moe import fused_moe_triton
from .tuning import CONFIG_DIR, config_file_name, device_key, load_configs


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
