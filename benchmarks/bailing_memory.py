"""Decode memory per request against sequence length on a `bailing_hybrid` (Ling-3.0) checkpoint:
the KDA layers' state must stay constant, only the MLA layers' latents grow.

    python benchmarks/bailing_memory.py --model DIR --lengths 256,512,1024,2048,4096 \
        --out docs/measurements/ling3-memory.json --plot docs/ling3-memory.png

For each length L, in a fresh process (so one length's allocations do not linger into the next):
load the model, read the process RSS, run one request of L - decode tokens of prompt (random ids)
plus `--decode` greedy tokens through an engine session whose cache holds exactly one request of
length L, and read after every decode step
- the engine's own accounting: KDA bytes (`HybridCache.state_bytes_per_request`: recurrent states
  plus convolution tails, per request) and MLA bytes (the KV blocks in the request's block table x
  block size x `latent_bytes_per_token`);
- the process RSS minus the RSS after loading, after `malloc_trim(0)` (freed prefill temporaries
  returned to the system, so what is left is what decoding holds: the cache pools, the state slots
  and the working set of one decode step). The session allocates (and zeroes) its latent pool for
  every request the scheduler may keep resident (a few times L tokens), so the RSS follows the pool
  as allocated, beside it in the plot; a constant part is the engine's own copy of the experts
  (kernel=fused keeps them in bfloat16).
The plot shows the accounting per request (left) and the RSS growth with L (right).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS then includes freed prefill buffers, and the figures say so
        print("malloc_trim unavailable: RSS includes freed prefill buffers", file=sys.stderr)


def measure_one(model: Path, length: int, decode: int, kernel: str, threads: int) -> dict:
    import torch

    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.sequence import Sequence

    torch.set_num_threads(threads)
    ckpt = load_checkpoint(model)
    trim()
    base = rss_bytes()
    rt = RuntimeConfig(batch_size=1, max_new_tokens=decode, kernel=kernel, scheduler="continuous",
                       max_tokens_per_step=length)
    engine = Engine(ckpt, None, rt)
    engine.eos_ids = set()
    session = engine.session(length)
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(2, ckpt.config.vocab_size, (length - decode,), generator=g).tolist()
    seq = Sequence(Request("r0", ""), prompt, decode, time.perf_counter())
    session.add(seq)
    cache, bm = session.kv, session.block_manager
    kda = cache.state_bytes_per_request()
    samples = []
    try:
        while session.has_work():
            record = session.step().to_dict()
            if record["phase"] == "prefill":
                trim()
                continue
            tokens = len(seq.prompt_ids) + len(seq.output_ids)
            mla = len(seq.block_table) * bm.block_size * cache.latent_bytes_per_token() if not seq.finished else None
            samples.append({"tokens": tokens, "rss_growth": rss_bytes() - base, "mla_bytes": mla})
    finally:
        session.close()
    last = [s for s in samples if s["mla_bytes"] is not None][-1]
    return {
        "length": length, "decode_tokens": decode, "kda_bytes": kda, "mla_bytes": last["mla_bytes"],
        "mla_bytes_per_token": cache.latent_bytes_per_token(), "rss_after_load": base,
        "rss_growth_decode_max": max(s["rss_growth"] for s in samples),
        "rss_growth_decode_first": samples[0]["rss_growth"], "rss_growth_decode_last": samples[-1]["rss_growth"],
        "kda_layers": len(cache.recurrent), "mla_layers": len(cache.latent),
        "kv_pool_tokens": bm.num_blocks * bm.block_size,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = [r["length"] for r in rows]
    mb = 1 / 2**20
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    left.plot(L, [r["kda_bytes"] * mb for r in rows], "o-", label=f"KDA state, {rows[0]['kda_layers']} layers")
    left.plot(L, [r["mla_bytes"] * mb for r in rows], "s-", label=f"MLA latents, {rows[0]['mla_layers']} layers")
    left.set_title("engine's cache accounting, per request", fontsize=10)
    base = rows[0]["rss_growth_decode_max"]
    right.plot(L, [(r["rss_growth_decode_max"] - base) * mb for r in rows], "^-",
               label=f"process RSS while decoding, above L={L[0]}")
    pool = [r["kv_pool_tokens"] * r["mla_bytes_per_token"] for r in rows]
    right.plot(L, [(p - pool[0]) * mb for p in pool], "s--",
               label=f"MLA latent pool as allocated ({rows[-1]['kv_pool_tokens'] / L[-1]:.0f} x L tokens), above L={L[0]}")
    right.set_title(f"process RSS (at L={L[0]}: {base * mb:.0f} MiB above the loaded model)", fontsize=10)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(L, [str(x) for x in L])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--decode", type=int, default=8, help="decode steps measured at each length")
    ap.add_argument("--kernel", default="fused")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, help="draw --plot from this --out file, measure nothing")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure this length
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.model, args.one, args.decode, args.kernel, args.threads)))
        return
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot(saved["rows"], args.plot, f"{Path(saved['model']).name}: decode memory of one request")
        return
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        out = subprocess.run([sys.executable, __file__, "--model", str(args.model), "--one", str(length),
                              "--decode", str(args.decode), "--kernel", args.kernel, "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(f"L={length:6d}: KDA {row['kda_bytes'] / 2**20:6.2f} MiB, MLA {row['mla_bytes'] / 2**20:6.2f} MiB, "
              f"RSS growth while decoding {row['rss_growth_decode_max'] / 2**20:7.1f} MiB "
              f"(first {row['rss_growth_decode_first'] / 2**20:.1f}, last {row['rss_growth_decode_last'] / 2**20:.1f})",
              flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": str(args.model), "kernel": args.kernel, "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot, f"{args.model.name}: decode memory of one request")


if __name__ == "__main__":
    main()
