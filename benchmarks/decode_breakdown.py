"""Where a decode step of the bundled runtime goes: attention, router, experts, LM head, the rest of
the forward, and what happens outside it (batch building, argmax, bookkeeping), per step, for each
thread count and batch. Each part is timed with perf_counter around the model's own methods (the
fused MoE kernel and the projections are C++ calls torch.profiler does not see inside); the CPU
time of every thread of the process over the measured run is printed too (a helper thread burning
CPU while the step waits shows there). Where a decode step's layers run as one native call
(MoeTransformer.native_decode_layers) they are one part; MOEBENCH_DECODE_CHAINS=0 (the chains override,
read here) with --decode-path chained runs them one by one and splits them into attention, router and experts; the native call splits itself the same way
(DecodeLayers.part_seconds, its own clock around each op). Where a part's weight bytes are fixed
(the dense projections, the LM head) its read rate is printed too, and the experts' from the
distinct experts each step routed to.

    flock /tmp/moebench-bench.lock python benchmarks/decode_breakdown.py --model random-0.89b --dtype bf16 --threads 1,2 --batch 1,16

--model: `bundled`, `random-0.89b` (the model bench-engine measures, written to a temporary folder;
--dtype bf16 writes it in bfloat16) or a qwen3_moe checkpoint folder. The experts are held in the
checkpoint's own dtype, as `run` and bench-engine hold them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from collections import defaultdict

import torch

from moebench.engine import Engine, Request, RuntimeConfig
from moebench.engine import model as model_module
from moebench.engine import moe as moe_module
from moebench.engine import runner as runner_module
from moebench.engine.config import DECODE_PATHS
from moebench.engine.overrides import Overrides
from moebench.kernels import cpu_dense
from moebench.measuring.bench_models import scratch_checkpoint

parts = defaultdict(float)
timing = [False]  # only decode forwards are timed
pool_in_decode = defaultdict(int)  # the thread pool's counters over the decode forwards only (not the prefill's)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        if not timing[0]:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        parts[name] += time.perf_counter() - start
        return result
    return wrapper


def instrument() -> None:
    transformer = model_module.MoeTransformer
    # the sub-layer, not `attention`: a decode step runs it as one native call (csrc/decode_layer.cpp)
    transformer.attention_sublayer = timed("attention (qkv, attention, output projection, add + norm)",
                                           transformer.attention_sublayer)
    transformer.route = timed("router (projection, softmax, top-k)", transformer.route)
    moe_module.FusedMoe.compute = timed("experts (fused MoE kernel)", moe_module.FusedMoe.compute)
    native_layers = transformer.native_decode_layers

    class TimedLayers:
        """The native call timed as a whole, and split into its parts by its own clock."""

        def __init__(self, layers):
            self.layers = layers

        def run(self, *args):
            if not timing[0]:
                return self.layers.run(*args)
            before = self.layers.part_seconds()
            start = time.perf_counter()
            result = self.layers.run(*args)
            whole = time.perf_counter() - start
            after = self.layers.part_seconds()
            for name, seconds in after.items():
                parts[f"layers: {name}"] += seconds - before[name]
            parts["layers: the native call's own work (bookkeeping between its parts)"] += (
                whole - sum(after.values()) + sum(before.values()))
            return result

    def timed_native_layers(self, experts):
        layers, head_inside = native_layers(self, experts)
        return TimedLayers(layers), head_inside

    transformer.native_decode_layers = timed_native_layers
    transformer.logits = timed("LM head", transformer.logits)  # after the layers, where the native call leaves it
    step_runner = runner_module.StepRunner  # every runner's run: the engine's step calls it
    forward = step_runner.run

    def timed_forward(self, batch, kv, all_positions=False):
        timing[0] = batch.max_q == 1
        pool_before = cpu_dense.pool_stats() if timing[0] else None  # read outside the timed forward
        start = time.perf_counter()
        result = forward(self, batch, kv, all_positions)
        if timing[0]:
            parts["forward"] += time.perf_counter() - start
            for key, value in (cpu_dense.pool_stats() or {}).items():
                pool_in_decode[key] += value - pool_before.get(key, 0)
        timing[0] = False
        return result

    step_runner.run = timed_forward


def weight_bytes(engine, decode_steps: list[dict]) -> dict[str, float]:
    """Weight bytes a decode step reads in each part of the native call, as the engine holds them
    (--weights int8 / int4 rows with their scales; --lm-head's precision): the dense projections' and,
    from the steps' routing records, the routed experts' (distinct experts per layer, counted as the
    engine's bytes_read counts them), averaged over the steps."""
    from moebench.engine.quantize import lm_head_bytes

    ckpt, cfg = engine.ckpt, engine.cfg

    def size(t):
        return t.numel() * t.element_size()

    def total(name):
        return sum(size(getattr(w, name)) for w in ckpt.layers)
    moe = [w for i, w in enumerate(ckpt.layers) if cfg.is_moe_layer(i)]
    per_expert = (size(moe[0].w13) + size(moe[0].w2)) / cfg.num_experts if moe else 0.0
    distinct = sum(s["distinct_experts"] for s in decode_steps) / len(decode_steps)
    # the head in its own precision (f32: as the checkpoint holds it); in the native call or after the layer loop
    full = ckpt.lm_head.element_size()
    lm_head = lm_head_bytes(cfg.vocab_size, cfg.hidden_size, engine.runtime.lm_head, full)
    return {"layers: qkv projection": total("qkv_proj"), "layers: output projection": total("o_proj"),
            "layers: router": total("router"), "LM head": lm_head, "layers: LM head": lm_head,
            "layers: experts": distinct * per_expert * len(moe)}


def thread_cpu_ms() -> dict[str, int]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/stat"):
        fields = open(path).read().rsplit(")", 1)[1].split()
        name = open(path[:-len("stat")] + "comm").read().strip()
        out[f"{path.split('/')[4]} {name}"] = (int(fields[11]) + int(fields[12])) * 1000 // ticks
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--weights", default="f32", help="f32 or int8 (--weights of run and bench-engine)")
    parser.add_argument("--lm-head", default="f32", help="f32, bf16, int8 or fp8 (--lm-head)")
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="bf16", help="for --model random-0.89b")
    parser.add_argument("--decode-path", default="native", choices=DECODE_PATHS,
                        help="the runtime's decode path (--decode-path of run); native, as bench-engine runs it by default")
    args = parser.parse_args()
    ckpt = scratch_checkpoint(args.model, args.dtype)
    instrument()
    batches = [int(b) for b in args.batch.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, ckpt.config.vocab_size, (max(batches), args.prompt_len), generator=g).tolist()
    results = {}
    for threads in (int(t) for t in args.threads.split(",")):
        for b in batches:
            torch.set_num_threads(threads)
            engine = Engine(ckpt, None, RuntimeConfig(kernel="fused", scheduler="static", batch_size=b,
                                                      max_new_tokens=args.new_tokens, weights=args.weights,
                                                      lm_head=args.lm_head, decode_path=args.decode_path,
                                                      overrides=Overrides.from_environment(os.environ)))
            engine.generate([Request(f"w{i}", "", 4) for i in range(b)], prompt_ids=prompts[:b])  # warm-up
            parts.clear()
            pool_in_decode.clear()
            cpu_before, wall_before = thread_cpu_ms(), time.perf_counter()
            result = engine.generate([Request(f"r{i}", "", args.new_tokens) for i in range(b)], prompt_ids=prompts[:b])
            wall_ms = (time.perf_counter() - wall_before) * 1000
            cpu_after = thread_cpu_ms()
            pool = pool_in_decode
            decode = [s for s in result.steps if s["phase"] == "decode"]
            if not decode:  # a trained model (the bundled one) can end a random prompt at once
                raise SystemExit(f"decode_breakdown: {args.model} ended every sequence before a decode step; "
                                 "measure a random model (--model random-0.89b) instead")
            step_ms = sum(s["duration_s"] for s in decode) / len(decode) * 1000
            per_step = {name: seconds / len(decode) * 1000 for name, seconds in parts.items()}
            forward_ms = per_step.pop("forward")
            per_step["other forward work (norms, embedding, residual adds, expert store)"] = forward_ms - sum(per_step.values())
            per_step["outside the forward (batch building, argmax, bookkeeping)"] = step_ms - forward_ms
            busy = {tid: cpu_after[tid] - cpu_before.get(tid, 0) for tid in cpu_after
                    if cpu_after[tid] - cpu_before.get(tid, 0) > 0}
            print(f"threads={threads} batch={b}: step {step_ms:.1f} ms, {b * 1000 / step_ms:.1f} tok/s, "
                  f"{decode[0]['bytes_read'] / 1e6:.0f} MB per step; thread CPU ms over the run "
                  f"({wall_ms:.0f} ms wall): {busy}")
            steps = len(decode)
            pooled = threads > 1 and pool.get("sections")
            # a share of the parts' time, not a part of its own
            caller_wait_ms = pool["caller_wait_ns"] / steps / 1e6 if pooled else None
            if pooled:
                print(f"   thread pool over the decode steps: {pool['sections'] / steps:.0f} parallel sections per step; "
                      f"{pool['worker_sleeps'] / steps:.1f} worker sleeps and {pool['spins_refused'] / steps:.1f} "
                      f"spins refused (more runnable threads than cores) per step")
                print(f"   section ends: the calling thread waited for a worker's last item at "
                      f"{pool['caller_waits'] / steps:.0f} per step, {caller_wait_ms * 1e3:.0f} us "
                      f"per step in all ({caller_wait_ms / step_ms:.0%} of the step)")
            part_bytes = weight_bytes(engine, decode)
            for name, ms in per_step.items():
                rate = (f", {part_bytes[name] / ms / 1e6:.1f} GB/s" if name in part_bytes and ms > 0 else "")
                print(f"   {name}: {ms:.2f} ms ({ms / step_ms:.0%}{rate})")
            results[f"threads={threads} batch={b}"] = {
                "step_ms": step_ms, "parts_ms": per_step, "bytes_per_step": decode[0]["bytes_read"],
                **({"caller_wait_ms_per_step": caller_wait_ms} if pooled else {})}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
