"""The CPU kernels' tiles of 4+ tokens (dense projections and LM head: dense_cpu.cpp tile_groups; the
fused MoE's experts with 4+ tokens: moe_cpu.cpp rows8_tokens) with the AVX2 kernel and with the
AVX-512 one, side by side: interleaved rounds, each kernel in its own process (the choice is made
once per process, MOEBENCH_AVX512=0 keeps AVX2), the order rotated each round. Both give the same
sums bit for bit (tests/kernels/test_avx512_streams.py); this prints what the AVX-512 registers buy.

    flock /tmp/moebench-bench.lock python benchmarks/tile_kernels.py --dtype bf16 --tokens 1 4 5 8 16 --rounds 5

Cases, at the 0.89B Qwen3-MoE shape (hidden 1024, 128 experts of 256, vocab 32000), one thread:
`lm_head` dense_linear 32000 x 1024 (65-131 MB, streamed from memory); `qkv` 1536 x 1024 for 50 calls
(in cache after the first); `moe verify` one MoE layer where every token routes to the same 8
experts (a K = n - 1 verify step of one sequence); `moe batch` n tokens routed at random. Each
figure is the fastest of --repeats calls (the machine's noise only ever adds time), per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KERNELS = ("avx2", "avx512")


def measure(dtype_name: str, tokens: list[int], repeats: int) -> dict:
    import torch

    from moebench.engine import memory
    from moebench.kernels.cpu_moe import load_extension

    torch.set_num_threads(1)
    from moebench.engine.overrides import Overrides, apply_process_overrides

    apply_process_overrides(Overrides.from_environment(os.environ))  # the child's entry: MOEBENCH_AVX512
    ext = load_extension()
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype_name]
    g = torch.Generator().manual_seed(0)

    def held(*shape):
        w = memory.empty(shape, dtype)
        w.copy_((torch.randn(*shape, generator=g) / 16).to(dtype))
        return w

    E, H, I, V = 128, 1024, 256, 32000
    head, qkv, w13, w2 = held(V, H), held(1536, H), held(E, 2 * I, H), held(E, H, I)

    def fastest(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    out = {}
    with ext.StepThreads(True):
        for n in tokens:
            x = torch.randn(n, H, generator=g)
            same = torch.randperm(E, generator=g)[:8].expand(n, 8).contiguous()
            spread = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(n)])
            tw = torch.rand(n, 8, generator=g)
            out[f"lm_head n={n}"] = fastest(lambda: ext.dense_linear(x, head, None))
            out[f"qkv x50 n={n}"] = fastest(lambda: [ext.dense_linear(x, qkv, None) for _ in range(50)])
            out[f"moe verify n={n}"] = fastest(lambda: ext.fused_moe(x, tw, same, w13, w2))
            out[f"moe batch n={n}"] = fastest(lambda: ext.fused_moe(x, tw, spread, w13, w2))
    return {"ms": out, "simd": dict(ext.simd_stats())}


def child(kernel: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MOEBENCH_AVX512"}
    if kernel == "avx2":
        env["MOEBENCH_AVX512"] = "0"
    cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--repeats", str(args.repeats),
           "--tokens", *map(str, args.tokens)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ran = result["simd"]["streams"]
    if ran != kernel:
        sys.exit(f"tile_kernels: asked for the {kernel} kernel, the extension ran {ran} (no AVX-512 on this CPU?)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 5, 8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.dtype, args.tokens, args.repeats)))
        return

    rounds = {k: [] for k in KERNELS}
    for r in range(args.rounds):
        for kernel in (KERNELS if r % 2 == 0 else KERNELS[::-1]):
            rounds[kernel].append(child(kernel, args)["ms"])
            print(f"round {r + 1}/{args.rounds}: {kernel} done", file=sys.stderr, flush=True)
    print(f"{args.dtype}, one thread, fastest of {args.repeats} calls per round, {args.rounds} rounds (medians)")
    print(f"{'case':<20} {'avx2 ms':>9} {'avx512 ms':>10} {'avx2/avx512':>12}  per round")
    for case in rounds["avx2"][0]:
        a = [r[case] for r in rounds["avx2"]]
        b = [r[case] for r in rounds["avx512"]]
        per_round = ", ".join(f"{x / y:.2f}" for x, y in zip(a, b))
        print(f"{case:<20} {statistics.median(a):>9.2f} {statistics.median(b):>10.2f} "
              f"{statistics.median(x / y for x, y in zip(a, b)):>11.2f}x  {per_round}")


if __name__ == "__main__":
    main()
