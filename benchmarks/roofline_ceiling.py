"""What bench-engine's paired roofline allows at all: a pure weight stream scored as the engine is.

bench-engine scores a run's decode rate against the better of the bandwidth probes taken just before
and just after it (each probe the best of 3 reads of 256 MB per reader). Where the host's bandwidth
drifts within seconds, a best-of-3 burst can outrun what anything sustains over a 1-2 s run. Each
round here takes a probe, then `read_in_runs` looping over a buffer of one decode step's bytes for
about as long as a run, a probe, then the bundled runtime (the rate from a 64-token run less a
1-token run, as bench-engine), a probe; each is scored against the better probe beside it. The
stream's fraction is the most any engine could score in those minutes.

    flock /tmp/moebench-bench.lock python benchmarks/roofline_ceiling.py --model random-0.89b --dtype bf16 \
        --threads 1 --batch 1 --weights int8 --lm-head int8

--model: `random-0.89b` (the model bench-engine measures, written to a temporary folder), `bundled` or a
qwen3_moe checkpoint folder. --weights, --lm-head and --decode-path as bench-engine's (native by default, as
there); MOEBENCH_ACTIVATIONS=q8 in the environment as its --activations q8. The stream reads one step's
bytes in the engine's precision.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moebench.engine import Engine, Request, RuntimeConfig, memory
from moebench.engine.config import DECODE_PATHS
from moebench.engine.overrides import Overrides
from moebench.kernels.cpu_moe import load_extension
from moebench.measuring.bench_engine import collect_garbage_before_timing, decode_bytes_per_step, decode_rate
from moebench.measuring.bench_models import scratch_checkpoint
from moebench.measuring.machine import read_bandwidth_by_reader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="f32", help="for --model random-0.89b")
    parser.add_argument("--weights", default="f32", help="f32, int8 or int4 (bench-engine's --weights)")
    parser.add_argument("--lm-head", default="f32", help="f32, bf16, int8 or fp8 (bench-engine's --lm-head)")
    parser.add_argument("--decode-path", default="native", choices=DECODE_PATHS,
                        help="the runtime's decode path; native, as bench-engine runs it by default")
    args = parser.parse_args()
    ext = load_extension()
    if ext is None:
        raise SystemExit("the CPU extension is not built: nothing streams as the engine does")
    ckpt = scratch_checkpoint(args.model, args.dtype)
    overrides = Overrides.from_environment(os.environ)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, ckpt.config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()

    # one engine for every run, as bench-engine keeps one: its setup (quantizing --weights) is not timed
    bundled = Engine(ckpt, None, RuntimeConfig(kernel="fused", scheduler="static", batch_size=args.batch,
                                               max_new_tokens=args.new_tokens, weights=args.weights,
                                               lm_head=args.lm_head, decode_path=args.decode_path,
                                               overrides=overrides))

    def engine(new_tokens: int):
        collect_garbage_before_timing()
        start = time.perf_counter()
        result = bundled.generate([Request(f"r{i}", "", new_tokens) for i in range(args.batch)], prompt_ids=prompts)
        return time.perf_counter() - start, result

    _, first = engine(2)
    step_bytes = decode_bytes_per_step(first.steps)
    # whole items of read_in_runs (1 MB), at least one
    buffer = memory.empty((max(1, int(step_bytes) // 4 // (1 << 18)) * (1 << 18),), torch.float32)
    buffer.fill_(1.0)
    # --weights f32 keeps the checkpoint's dtype: name what the model holds, and the decode path that ran,
    # as the run's evidence has them
    held = args.weights if args.weights != "f32" else first.evidence.get("weights", {}).get("held", {}).get("dense")
    ran = first.evidence["decode_path"]
    print(f"{step_bytes / 1e6:.1f} MB per decode step ({held} weights, {args.lm_head} LM head); decode path "
          f"{ran['path']}, steps {ran['decode_steps']}; the stream reads {buffer.numel() * 4 / 1e6:.1f} MB per pass",
          flush=True)

    def stream(seconds: float) -> float:
        """GB/s of read_in_runs looping over the buffer for about `seconds`, on the run's threads."""
        ext.set_pool_threads(args.threads)
        try:
            passes, start = 0, time.perf_counter()
            while passes == 0 or time.perf_counter() - start < seconds:
                ext.read_in_runs(buffer)
                passes += 1
            return passes * buffer.numel() * 4 / (time.perf_counter() - start) / 1e9
        finally:
            ext.set_pool_threads(0)

    def probe() -> float:
        torch.set_num_threads(args.threads)
        return max(read_bandwidth_by_reader().values())

    streams, engines = [], []
    for round_ in range(args.rounds):
        before = probe()
        short_s, _ = engine(1)
        long_s, result = engine(args.new_tokens)
        middle = probe()
        engine_gb_s = (decode_rate(args.batch, args.new_tokens, short_s, long_s)
                       * decode_bytes_per_step(result.steps) / args.batch / 1e9)
        stream_gb_s = stream(long_s - short_s)
        after = probe()
        engines.append(engine_gb_s / max(before, middle))
        streams.append(stream_gb_s / max(middle, after))
        print(f"round {round_}: probes {before:.1f} / {middle:.1f} / {after:.1f} GB/s; engine {engine_gb_s:.1f} GB/s "
              f"({engines[-1]:.0%}); pure stream {stream_gb_s:.1f} GB/s ({streams[-1]:.0%})", flush=True)
    print(f"threads={args.threads} batch={args.batch}, median over {args.rounds} rounds of the paired fraction: "
          f"pure stream {statistics.median(streams):.0%} (range {min(streams):.0%}-{max(streams):.0%}), "
          f"engine {statistics.median(engines):.0%} (range {min(engines):.0%}-{max(engines):.0%})")


if __name__ == "__main__":
    main()
