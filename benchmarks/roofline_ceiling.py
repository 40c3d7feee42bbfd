"""What bench-engine's paired roofline allows at all: a pure weight stream scored as the engine is.

bench-engine scores a run's decode rate against the better of the bandwidth probes taken just before
and just after it (each probe the best of 3 reads of 256 MB per reader). Where the host's bandwidth
drifts within seconds, a best-of-3 burst can outrun what anything sustains over a 1-2 s run. Each
round here takes a probe, then `read_in_runs` looping over a buffer of one decode step's bytes for
about as long as a run, a probe, then the bundled runtime (the rate from a 64-token run less a
1-token run, as bench-engine), a probe; each is scored against the better probe beside it. The
stream's fraction is the most any engine could score in those minutes.

    flock /tmp/moebench-bench.lock python benchmarks/roofline_ceiling.py --model DIR --threads 2 --batch 1

DIR: a qwen3_moe checkpoint (e.g. moebench.models.random.make_random_qwen3_moe(DIR,
moebench.measuring.bench_engine.DEFAULT_SHAPE, pad_token_id=0)).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moebench.measuring.bench_engine import decode_bytes_per_step, decode_rate
from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint, memory
from moebench.kernels.cpu_moe import load_extension
from moebench.measuring.machine import read_bandwidth_by_reader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    ext = load_extension()
    if ext is None:
        raise SystemExit("the CPU extension is not built: nothing streams as the engine does")
    ckpt = load_checkpoint(args.model)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, ckpt.config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()

    def engine(new_tokens: int):
        runtime = RuntimeConfig(kernel="fused", scheduler="static", batch_size=args.batch, max_new_tokens=new_tokens)
        start = time.perf_counter()
        result = Engine(ckpt, None, runtime).generate(
            [Request(f"r{i}", "", new_tokens) for i in range(args.batch)], prompt_ids=prompts)
        return time.perf_counter() - start, result

    _, first = engine(2)
    step_bytes = decode_bytes_per_step(first.steps)
    buffer = memory.empty((int(step_bytes) // 4 // (1 << 18) * (1 << 18),), torch.float32)
    buffer.fill_(1.0)

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
