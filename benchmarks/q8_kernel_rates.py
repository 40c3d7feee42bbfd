"""The q8 integer dot kernels (kernels/csrc/q8_cpu.h: int4 rows and row-scaled int8 rows against q8
activations) in nanoseconds per block of 32 weights and token, through dense_linear at the 0.89B
Qwen3-MoE's shapes, and what those rates leave of batch 16's roofline targets: the integer dots of one
batch-16 step alone at the fastest rate measured, against the step time that 50% of a bench-engine run's
roofline allows (--bench-json, one of docs/measurements/bench-engine-*.json with int weights).

    flock /tmp/moebench-bench.lock python benchmarks/q8_kernel_rates.py --threads 1 2 \
        --bench-json docs/measurements/bench-engine-int8-q8-vs-llamacpp-q8_0-avx2-quiet.json

Shapes: K = 1024 (the LM head's 32000 rows, and every projection that reads the hidden state) and K = 256
(an expert's down projection, 32768 rows here). Each figure is the fastest of --repeats calls on one
matrix, whose 8-33 MB partly stay in a 32 MB L3 between calls; at 3+ tokens the kernel's arithmetic, not
the bytes, sets the time.

--from-memory: one token against the LM head's shape from memory (enough matrices, cycled, for 256 MB
a pass), in GB/s of weights beside `read_in_runs` (the weight kernels' reads alone) over as many bytes:
how much of a pure stream's rate a one-token step keeps with its arithmetic on the same core.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

# the 0.89B Qwen3-MoE (harness/measuring/bench_models.py: DEFAULT_SHAPE)
HIDDEN, LAYERS, EXPERTS_PER_TOKEN, EXPERT_WIDTH, VOCAB = 1024, 8, 8, 256, 32000
QKV_ROWS, OUTPUT_ROWS = 1024 + 2 * 256, 1024
BLOCK = 32


def step_block_tokens(batch: int) -> dict[str, float]:
    """Blocks of 32 weights times the tokens that meet them, in one decode step of `batch` tokens."""
    experts = batch * EXPERTS_PER_TOKEN * LAYERS * 3 * EXPERT_WIDTH * HIDDEN / BLOCK
    projections = batch * LAYERS * (QKV_ROWS + OUTPUT_ROWS) * HIDDEN / BLOCK
    head = batch * VOCAB * HIDDEN / BLOCK
    return {"experts": experts, "projections": projections, "lm_head": head}


@contextmanager
def q8_activations(ext):
    """The extension's activations set to q8 inside, and back to what they were after."""
    found = ext.activations()
    ext.set_activations("q8")
    try:
        yield
    finally:
        ext.set_activations(found)


def extension_and_packer(weights: str):
    """(the C++ extension, the function that packs float rows into `weights`' rows); stops where the
    extension did not build."""
    from moebench.engine.quantize import pack_int4_rows, pack_int8_rows
    from moebench.kernels.cpu_moe import load_extension

    ext = load_extension()
    if ext is None or not hasattr(ext, "set_activations"):
        raise SystemExit("q8_kernel_rates: the C++ extension did not build")
    return ext, {"int4": pack_int4_rows, "int8": pack_int8_rows}[weights]


def measure(weights: str, tokens: list[int], threads: int, repeats: int) -> dict[str, dict[int, float]]:
    import torch

    ext, pack = extension_and_packer(weights)
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    rates: dict[str, dict[int, float]] = {}
    with q8_activations(ext), ext.StepThreads(True):
        for rows, cols in ((VOCAB, HIDDEN), (32768, EXPERT_WIDTH)):
            w = pack(torch.randn(rows, cols, generator=g))
            rates[f"K={cols}"] = {}
            for n in tokens:
                x = torch.randn(n, cols, generator=g)
                ext.dense_linear(x, w, None)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    ext.dense_linear(x, w, None)
                    best = min(best, time.perf_counter() - start)
                rates[f"K={cols}"][n] = best * 1e9 / (rows * cols / BLOCK * n)
    stats = ext.simd_stats()
    if stats["q8_weight_rows"] == 0:
        raise SystemExit("q8_kernel_rates: the q8 kernels did not run (q8_weight_rows is 0)")
    return rates


def from_memory(weights: str, threads: int, passes: int = 3) -> tuple[float, float]:
    """(the one-token q8 kernel's GB/s, read_in_runs' GB/s), the fastest of `passes` passes over 256 MB."""
    import torch

    from moebench.engine import memory

    ext, pack = extension_and_packer(weights)
    g = torch.Generator().manual_seed(1)
    first = pack(torch.randn(VOCAB, HIDDEN, generator=g))
    matrices = [first] + [pack(torch.randn(VOCAB, HIDDEN, generator=g))
                          for _ in range(-(-(256 << 20) // first.nbytes) - 1)]
    total = sum(m.nbytes for m in matrices)
    x = torch.randn(1, HIDDEN, generator=g)
    buffer = memory.empty((total // 4 // (1 << 18) * (1 << 18),), torch.float32)
    buffer.fill_(1.0)
    torch.set_num_threads(threads)
    kernel = stream = 0.0
    # both on the step's pool, with the same threads
    with q8_activations(ext), ext.StepThreads(True):
        for _ in range(passes):
            start = time.perf_counter()
            for m in matrices:
                ext.dense_linear(x, m, None)
            kernel = max(kernel, total / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            ext.read_in_runs(buffer)
            stream = max(stream, buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return kernel, stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bench-json", help="a bench-engine JSON: its batch-16 rows give the step's bytes and bandwidth")
    parser.add_argument("--from-memory", action="store_true",
                        help="also one token from memory against a pure stream (read_in_runs), in GB/s")
    args = parser.parse_args()

    block_tokens = step_block_tokens(16)
    budget_ms = {}  # threads -> the step time 50% of the run's roofline allows, for the run's --weights
    run_weights = None
    if args.bench_json:
        run = json.loads(Path(args.bench_json).read_text())
        run_weights = run.get("weights")
        for row in run["rows"]:
            if row["batch"] == 16:
                budget_ms[row["threads"]] = row["bytes_per_step"] / (row["bandwidth_gb_s"] * 1e9) / 0.5 * 1e3

    for threads in args.threads:
        fastest = {}
        for weights in ("int4", "int8"):
            rates = measure(weights, args.tokens, threads, args.repeats)
            for shape, by_tokens in rates.items():
                cells = "  ".join(f"{n} tok {ns:.3f}" for n, ns in by_tokens.items())
                print(f"{threads} thread(s), {weights} x q8, {shape}: ns per block and token (wall): {cells}")
            fastest[weights] = min(ns for by_tokens in rates.values() for ns in by_tokens.values())
        print(f"batch 16 at {threads} thread(s): {sum(block_tokens.values()) / 1e6:.1f} M block-token dots per step "
              f"(experts {block_tokens['experts'] / 1e6:.1f}, projections {block_tokens['projections'] / 1e6:.1f}, "
              f"LM head {block_tokens['lm_head'] / 1e6:.1f})")
        for weights in ("int4", "int8"):
            # an int4 run keeps an int8 LM head (bench-engine --lm-head int8): its head at int8's rate
            head_rate = fastest["int8"]
            floor_ms = ((block_tokens["experts"] + block_tokens["projections"]) * fastest[weights]
                        + block_tokens["lm_head"] * head_rate) / 1e6
            line = f"  {weights} weights, int8 head: the integer dots alone take >= {floor_ms:.1f} ms at the fastest rates"
            if threads in budget_ms and run_weights == weights:
                line += f"; 50% of the run's roofline allows {budget_ms[threads]:.1f} ms for the whole step"
            print(line)
        if args.from_memory:
            for weights in ("int4", "int8"):
                kernel, stream = from_memory(weights, threads)
                print(f"{threads} thread(s), {weights} x q8, one token from memory: {kernel:.1f} GB/s of weights; "
                      f"read_in_runs {stream:.1f} GB/s ({kernel / stream:.0%})")


if __name__ == "__main__":
    main()
