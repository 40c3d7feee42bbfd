"""What a fetch that hits costs: the Python expert store (PooledStore) vs the native one.

    flock /tmp/moebench-bench.lock python benchmarks/bench_store.py [--model DIR] [--calls 20000]

Every id of a call is resident and no load is in flight (the all-hit path a decode step takes when
the pool holds its experts), so the figure is the store's bookkeeping alone: the look-up of rows,
the LRU update, the counters. Batch 1 is one token's top-k ids, batch 16 sixteen tokens' (8 and 128
ids on the default model: the random qwen3_moe bench_prefetch uses, 64 experts top-8, 8 layers).
Each call goes to the next MoE layer in turn, as a forward pass does. Reports ns per call and per
id, the median of --repeats timed runs of --calls calls each, both stores interleaved.

End-to-end decode tok/s with either store: `python benchmarks/bench_prefetch.py --store both`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def _stores(ckpt, budget: float):
    from moebench.engine import RuntimeConfig
    from moebench.engine.store.expert_store import PooledStore
    from moebench.engine.store.factory import slots_for_budget
    from moebench.engine.store.native import NativePooledStore
    from moebench.engine.store.tiers import HostTier

    rt = RuntimeConfig(expert_budget=budget)
    slots = slots_for_budget(ckpt.config, rt)
    return {"python": PooledStore(ckpt, rt, HostTier(ckpt, "cpu"), slots, workers=1),
            "native": NativePooledStore(ckpt, rt, HostTier(ckpt, "cpu"), slots, workers=1)}


def _calls(cfg, quota: int, batch: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """`count` id tensors [batch, top_k], each token's ids distinct and among the experts every layer
    holds from the start (0 .. quota-1), so every call hits."""
    g = torch.Generator().manual_seed(seed)
    k = cfg.top_k
    return [torch.stack([torch.randperm(quota, generator=g)[:k] for _ in range(batch)]) for _ in range(count)]


def _time(store, layers: list[int], calls: list[torch.Tensor]) -> float:
    """Seconds for all the calls, layers in turn."""
    fetch = store.fetch
    n = len(layers)
    t0 = time.perf_counter()
    for i, ids in enumerate(calls):
        fetch(layers[i % n], ids)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    from bench_prefetch import random_checkpoint  # the sibling script (benchmarks/ is on sys.path when run)
    from moebench.engine import load_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="default: bench_prefetch's random qwen3_moe (E64 top-8)")
    ap.add_argument("--workdir", type=Path,
                    default=Path.home() / ".cache" / "moebench" / "bench-qwen3moe-h512-l8-e64k8-init0.15")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    path = args.model or random_checkpoint(args.workdir)
    ckpt = load_checkpoint(path, experts_in_checkpoint_dtype=True)
    cfg = ckpt.config
    stores = _stores(ckpt, args.budget)
    layers = list(stores["python"].pools)
    quota = stores["python"].quota
    print(f"model {path}: {len(layers)} MoE layers, {cfg.num_experts} experts top-{cfg.top_k}; budget {args.budget} "
          f"({quota} rows per layer); {args.calls} calls x {args.repeats} repeats; torch {torch.__version__}")
    print(f"{'batch':>5s} {'ids':>4s} {'store':>7s} {'ns/call':>9s} {'ns/id':>7s}  trials (ns/call)")
    figures = {}
    for batch in (int(b) for b in args.batch.split(",") if b):
        calls = _calls(cfg, quota, batch, args.calls)
        ids = batch * cfg.top_k
        per_call = {name: [] for name in stores}
        for name, store in stores.items():  # warm-up: code, caches, the tables
            _time(store, layers, calls[: min(2000, len(calls))])
        for _ in range(args.repeats):
            for name, store in stores.items():
                per_call[name].append(_time(store, layers, calls) / len(calls) * 1e9)
        for name, trials in per_call.items():
            med = statistics.median(trials)
            figures[batch, name] = med
            print(f"{batch:5d} {ids:4d} {name:>7s} {med:9.0f} {med / ids:7.1f}  {' '.join(f'{t:.0f}' for t in trials)}")
        for name, store in stores.items():
            step = store.take_step()
            assert step["expert_misses"] == 0 and step["bytes_loaded"] == 0, f"{name}: a call missed"
        print(f"{batch:5d} {ids:4d} python/native {figures[batch, 'python'] / figures[batch, 'native']:.1f}x")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for store in stores.values():
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
