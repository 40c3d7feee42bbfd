"""Runs of streamed rows sized in bytes against the fixed item sizes of before, in whole decode forwards.

With 1-3 tokens a kernel reads an item's weight rows as four runs side by side (cpu_common.h:
dot_rows_streamed). Items used to be a fixed row count (dense 64 rows, MoE gate/up blocks of 32
intermediate rows, down blocks of 256 output rows): runs of 64 KB in float32 but 32 KB in bfloat16.
They now take the rows of runs of about 128 KB (streamed_item_rows). The extension's
`set_stream_run_bytes` switches between the two in one process (0: the fixed sizes), so this
alternates them forward by forward, the order flipped each round, and prints per part of the native
decode call (DecodeLayers.part_seconds: its own clock around each op) the median ratio of the
paired rounds with its quartiles. Both give the same logits bit for bit (checked here on every
round's last forward). The attention part reads no weights: its ratio shows what the machine's
drift alone does.

    flock /tmp/moebench-bench.lock python benchmarks/run_lengths.py --model random-0.89b --dtype bf16 --threads 1 --batch 1 --rounds 40

--model: `bundled`, `random-0.89b` (written to a temporary folder; --dtype bf16 writes it in bfloat16)
or a qwen3_moe checkpoint folder.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

PARTS = ("LM head", "experts", "qkv projection", "output projection", "attention")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-0.89b")
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="bf16", help="for --model random-0.89b")
    parser.add_argument("--weights", choices=("f32", "int8"), default="f32", help="--weights of run and bench-engine")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--forwards", type=int, default=4, help="forwards per configuration per round")
    parser.add_argument("--run-kb", type=int, default=128, help="the run length to compare")
    parser.add_argument("--base-kb", type=int, default=0, help="the run length it is compared with (0: the fixed sizes)")
    args = parser.parse_args()

    from moebench.engine import Engine, RuntimeConfig
    from moebench.engine.runner import build_forward_batch
    from moebench.kernels.cpu_moe import load_extension
    from moebench.measuring.bench_models import scratch_checkpoint

    ext = load_extension()
    if ext is None or not hasattr(ext, "set_stream_run_bytes"):
        raise SystemExit("run_lengths: needs the CPU extension")
    torch.set_num_threads(args.threads)
    ckpt = scratch_checkpoint(args.model, args.dtype)
    rt = RuntimeConfig(kernel="fused", decode_path="native", batch_size=args.batch, weights=args.weights)
    session = Engine(ckpt, None, rt).session(256)
    model, bs = session.model, rt.kv_block_size
    g = torch.Generator().manual_seed(0)
    vocab = ckpt.config.vocab_size
    tables = []
    for _ in range(args.batch):  # a 160-token context per sequence
        table: list[int] = []
        session.block_manager.ensure_capacity(table, 170)
        tables.append(table)
        prompt = torch.randint(1, vocab, (160,), generator=g).tolist()
        model.forward(build_forward_batch([prompt], [0], [table], bs, rt.device), session.kv)
    batch = build_forward_batch([[5 + b] for b in range(args.batch)], [160] * args.batch, tables, bs, rt.device)
    native = session.runner.native  # the native runner's DecodeLayers (decode_path native was asked for)
    default_run_bytes = ext.stream_run_bytes()
    configs = {f"{args.base_kb} KB" if args.base_kb else "fixed": args.base_kb * 1024, f"{args.run_kb} KB": args.run_kb * 1024}
    times = {name: defaultdict(list) for name in configs}
    mismatches = 0
    for r in range(args.rounds):
        logits = {}
        for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            ext.set_stream_run_bytes(configs[name])
            spent, whole = defaultdict(float), 0.0
            for _ in range(args.forwards):
                before, start = native.part_seconds(), time.perf_counter()
                logits[name] = session.runner.run(batch, session.kv)  # (it enters the step's threads)
                whole += time.perf_counter() - start
                after = native.part_seconds()
                for part, seconds in after.items():
                    spent[part] += seconds - before[part]
            times[name]["forward"].append(whole / args.forwards * 1e3)
            for part in PARTS:
                times[name][part].append(spent[part] / args.forwards * 1e3)
        a, b = logits.values()
        mismatches += not torch.equal(a, b)
    ext.set_stream_run_bytes(default_run_bytes)
    fixed, sized = configs
    held = model.weights_evidence()["held"] if hasattr(model, "weights_evidence") else {}
    print(f"{args.model}, weights held {held}, LM head {ckpt.lm_head.dtype}, threads={args.threads} "
          f"batch={args.batch}, {args.rounds} rounds of {args.forwards} forwards each; "
          f"logits differed in {mismatches} of {args.rounds} rounds")
    for part in ("forward", *PARTS):
        ratios = [f / s for f, s in zip(times[fixed][part], times[sized][part]) if s > 0]
        if not ratios:
            continue
        low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(f"  {part}: {fixed} {statistics.median(times[fixed][part]):.2f} ms, {sized} "
              f"{statistics.median(times[sized][part]):.2f} ms; {fixed} / {sized}, median of rounds "
              f"{statistics.median(ratios):.3f} (quartiles {low:.3f}-{high:.3f})")
    if mismatches:
        raise SystemExit("run_lengths: the two item sizes gave different logits")


if __name__ == "__main__":
    main()
