"""Scheduler benchmark: static vs continuous batching (fifo and affinity admission), interleaved in
one process so that a shared machine's drift hits every configuration alike.

    python benchmarks/bench_scheduler.py make-model /tmp/rand-moe          # random qwen3_moe + BPE
    python benchmarks/bench_scheduler.py bench --model /tmp/rand-moe --data ../shared/data/gsm8k \
        --limit 48 --batch-size 16 --repeats 2

Random models do not stop by themselves, so every request gets its own `max_new_tokens`: the
length, in the model's tokens, of the item's reference solution (`--lengths reference`), which
gives the spread of output lengths a real model has on GSM8K. A trained model (the bundled one)
can use its own stops instead (`--lengths model`).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)

CONFIGS = {
    "static": dict(scheduler="static"),
    "continuous-fifo": dict(scheduler="continuous", admission="fifo"),
    "continuous-affinity": dict(scheduler="continuous", admission="affinity"),
}


@app.command("make-model")
def make_model(
    out: Path = typer.Argument(..., help="Directory to write config.json, model.safetensors, tokenizer.json."),
    data: Path = typer.Option(Path("../shared/data/gsm8k"), help="GSM8K directory; train.jsonl trains the tokenizer."),
    hidden: int = 512, layers: int = 8, experts: int = 64, top_k: int = 8, width: int = 256, vocab: int = 32000,
    seed: int = 0,
):
    """A random Qwen3-MoE of real proportions but small, and a byte-level BPE tokenizer trained on
    GSM8K's train split (so prompts have realistic token counts)."""
    from moebench.models.random import make_random_qwen3_moe
    from moebench.models.synth import gsm8k_bpe_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab = gsm8k_bpe_tokenizer(data, vocab, out)
    shape = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                 num_key_value_heads=max(1, hidden // 256), head_dim=64, num_experts=experts,
                 num_experts_per_tok=top_k, moe_intermediate_size=width, intermediate_size=4 * width)
    make_random_qwen3_moe(out, shape, seed=seed)
    print(f"wrote {out}: a random qwen3_moe ({hidden} hidden, {layers} layers, {experts} experts top-{top_k}), "
          f"tokenizer vocab {vocab}")


def _percentile(values, q):
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return float("nan")
    idx = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
    return values[idx]


class Lockstep:
    """Round-robin baton over the configs' engines, each in its own thread: one engine runs one
    step, then hands over. Load from other processes then hits every config alike, step by step.
    The baton passes between steps (in `has_work`, which the engine calls outside a step's timed
    window), so waiting for it never enters a step's duration."""

    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.active = list(range(n))
        self.turn = 0

    def _wait(self, i):
        while self.active[self.turn] != i:
            self.cond.wait()

    def enter(self, i):
        with self.cond:
            self._wait(i)

    def hand_over(self, i):
        with self.cond:
            self.turn = (self.active.index(i) + 1) % len(self.active)
            self.cond.notify_all()
            self._wait(i)

    def leave(self, i):
        with self.cond:
            pos = self.active.index(i)
            self.active.remove(i)
            self.turn = pos % len(self.active) if self.active else 0
            self.cond.notify_all()


class StepClock:
    """Wraps a scheduler: passes the baton between steps and keeps the engine's own clock (its time
    from getting the baton to handing it over, waiting excluded), so queue waits and latencies are
    those the config would have had alone.

    The engine calls `has_work()` before each step, outside the step's timed window (a step's
    `duration_s` starts just before `schedule()`), so the baton changes hands there: a step's
    duration is the engine's own work for it. (Handing over inside `schedule()` put the other
    configs' steps into every step's duration.)"""

    def __init__(self, scheduler, lockstep: Lockstep | None, index: int):
        self._inner = scheduler
        self._lockstep, self._index = lockstep, index
        self.clock = 0.0
        self._since = None  # when this engine last got the baton (perf_counter)
        self.first = {}  # request id -> own-clock time its first step started (queue wait)
        self.second = {}  # request id -> own-clock time its first decode step ended
        self.last = {}  # request id -> own-clock time its last step ended
        self._batch = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _step_ended(self):
        self.clock += time.perf_counter() - self._since
        for seq in self._batch:
            self.last[seq.id] = self.clock
            if len(seq.output_ids) >= 2:
                self.second.setdefault(seq.id, self.clock)
        self._batch = []

    def has_work(self):
        if self._since is None:
            if self._lockstep:
                self._lockstep.enter(self._index)
        else:
            self._step_ended()
            if self._lockstep:
                self._lockstep.hand_over(self._index)
        self._since = time.perf_counter()
        return self._inner.has_work()

    def schedule(self):
        batch = self._inner.schedule()
        now = self.clock + (time.perf_counter() - self._since)
        for seq in batch:
            self.first.setdefault(seq.id, now)
        self._batch = batch
        return batch

    def close(self):
        self._since = None  # the last step was counted when the engine asked has_work() after it


def _metrics(result, clock: StepClock, full: int) -> dict:
    decode = [s for s in result.steps if s["phase"] == "decode"]
    tokens = sum(s["decode_tokens"] for s in decode)
    seconds = sum(s["duration_s"] for s in decode)
    return {
        "decode_tok_s": tokens / seconds if seconds else float("nan"),
        "decode_tokens": tokens,
        "decode_s": seconds,
        "decode_steps": len(decode),
        # what a decode step costs besides the forward: choosing and building the batch, sampling, bookkeeping
        "decode_other_ms": (1e3 * statistics.fmean(s["duration_s"] - s["forward_s"] for s in decode)
                            if decode else float("nan")),
        "prefill_s": sum(s["duration_s"] for s in result.steps if s["phase"] != "decode"),
        "mean_batch": statistics.fmean(s["batch_size"] for s in decode) if decode else 0.0,
        "distinct_experts": statistics.fmean(s["distinct_experts"] for s in decode) if decode else 0.0,
        # batch size drives distinct experts; compare policies on full-batch steps too
        "distinct_full": statistics.fmean([s["distinct_experts"] for s in decode if s["batch_size"] == full] or [float("nan")]),
        "own_time_s": clock.clock,
        # every request arrives at time 0 of the engine's own clock
        "queue_wait_p95_s": _percentile(list(clock.first.values()), 0.95),
        # a request prefilled ahead may still wait for a decode slot: its second token shows it
        "second_token_p95_s": _percentile(list(clock.second.values()), 0.95),
        "latency_p95_s": _percentile(list(clock.last.values()), 0.95),
        "latency_mean_s": statistics.fmean(clock.last.values()),
    }


@app.command("bench")
def bench(
    model: Path = typer.Option(..., help="Checkpoint directory."),
    suite: str = typer.Option("gsm8k"),
    data: Optional[Path] = typer.Option(None),
    limit: int = typer.Option(48),
    num_fewshot: Optional[int] = typer.Option(None),
    batch_size: int = typer.Option(16),
    max_new_tokens: int = typer.Option(256),
    lengths: str = typer.Option("reference", help="reference: per-item max-new-tokens = reference solution length; model: the model's own stops."),
    configs: str = typer.Option(",".join(CONFIGS)),
    repeats: int = typer.Option(2),
    kernel: str = typer.Option("naive"),
    lockstep: bool = typer.Option(True, help="Interleave the configs step by step (threads, one runs at a time)."),
    out: Optional[Path] = typer.Option(None, help="Write per-trial metrics and step records as JSON here."),
):
    """Static vs continuous (fifo, affinity) on a suite's prompts; decode tok/s, distinct experts,
    queue wait, latency, and the share of outputs identical to the first config's."""
    import torch

    import moebench.engine.llm_engine as llm_engine
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.loader import load_tokenizer
    from moebench.suites import load_suite

    torch.manual_seed(0)
    ckpt = load_checkpoint(model)
    tokenizer = load_tokenizer(model)
    s = load_suite(suite, data, limit, num_fewshot=num_fewshot)
    prompts = [s.prompt(item) for item in s.items]
    prompt_ids = [tokenizer.encode(p).ids for p in prompts]
    if lengths == "reference":
        limits = [max(8, min(max_new_tokens, len(tokenizer.encode(" " + item.answer).ids))) for item in s.items]
        requests = [Request(item.id, p, n) for item, p, n in zip(s.items, prompts, limits)]
    else:
        requests = [Request(item.id, p, max_new_tokens, tuple(s.stop)) for item, p in zip(s.items, prompts)]
    print(f"{len(requests)} requests, prompt tokens mean {statistics.fmean(map(len, prompt_ids)):.0f}, "
          f"max_new_tokens mean {statistics.fmean(r.max_new_tokens for r in requests):.0f} "
          f"(min {min(r.max_new_tokens for r in requests)}, max {max(r.max_new_tokens for r in requests)})", flush=True)
    names = configs.split(",")
    base = RuntimeConfig(batch_size=batch_size, max_new_tokens=max_new_tokens, kernel=kernel)

    # every engine builds its scheduler through this: wrap it in the calling thread's StepClock
    original_make = llm_engine.make_scheduler
    local = threading.local()

    def make_scheduler(runtime, block_manager):
        local.clock = StepClock(original_make(runtime, block_manager), local.lockstep, local.index)
        return local.clock

    llm_engine.make_scheduler = make_scheduler

    def run(name, index, baton, slot):
        local.lockstep, local.index = baton, index
        try:
            result = Engine(ckpt, tokenizer, replace(base, **CONFIGS[name])).generate(requests, prompt_ids=prompt_ids)
            local.clock.close()
            slot[name] = (result, local.clock)
        finally:
            if baton:
                baton.leave(index)

    # warm-up: a few short requests per config (allocator, caches), not measured
    for name in names:
        local.lockstep, local.index = None, 0
        Engine(ckpt, tokenizer, replace(base, **CONFIGS[name])).generate(requests[:2], prompt_ids=[p[:64] for p in prompt_ids[:2]])
    rows, outputs, steps = [], {}, []
    for trial in range(repeats):
        slot = {}
        order = names if trial % 2 == 0 else names[::-1]  # who steps first alternates
        if lockstep:
            baton = Lockstep(len(order))
            threads = [threading.Thread(target=run, args=(n, i, baton, slot)) for i, n in enumerate(order)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for name in order:
                run(name, 0, None, slot)
        for name in names:
            result, clock = slot[name]
            m = _metrics(result, clock, batch_size)
            m.update(config=name, trial=trial, evidence=result.evidence["scheduler"], errors=result.activation_errors)
            rows.append(m)
            steps.extend({"config": name, "trial": trial, **st} for st in result.steps)
            outputs.setdefault(name, []).append([c.output_ids for c in result.completions])
            print(f"{name:>20} #{trial}: decode {m['decode_tok_s']:7.2f} tok/s  batch {m['mean_batch']:5.2f}  "
                  f"distinct {m['distinct_experts']:5.2f} (full batch {m['distinct_full']:5.2f})  "
                  f"queue p95 {m['queue_wait_p95_s']:6.1f}s  2nd-token p95 {m['second_token_p95_s']:6.1f}s  "
                  f"latency p95 {m['latency_p95_s']:6.1f}s  own time {m['own_time_s']:6.1f}s  "
                  f"decode step beyond forward {m['decode_other_ms']:5.3f} ms  "
                  f"{json.dumps(m['evidence'])}{'  ERRORS ' + str(m['errors']) if m['errors'] else ''}", flush=True)
    llm_engine.make_scheduler = original_make
    print()
    ref = outputs[names[0]][0]
    for name in names:
        mine = [r for r in rows if r["config"] == name]
        med = {k: statistics.median(r[k] for r in mine) for k in mine[0] if isinstance(mine[0][k], (int, float))}
        same = statistics.fmean(a == b for outs in outputs[name] for a, b in zip(outs, ref))
        ratios = [r["decode_tok_s"] / b["decode_tok_s"] for r, b in zip(mine, [r for r in rows if r["config"] == names[0]])]
        print(f"{name:>20}: decode {med['decode_tok_s']:7.2f} tok/s (x{statistics.median(ratios):.3f} vs {names[0]}; "
              f"trials {', '.join(f'{x:.3f}' for x in ratios)})  distinct/layer/decode step {med['distinct_experts']:5.2f} "
              f"(full batch {med['distinct_full']:5.2f})  queue p95 {med['queue_wait_p95_s']:6.1f}s  "
              f"2nd-token p95 {med['second_token_p95_s']:6.1f}s  latency p95 {med['latency_p95_s']:6.1f}s  "
              f"mean decode batch {med['mean_batch']:5.2f}  identical to {names[0]} {100 * same:.1f}%")
    if {"continuous-fifo", "continuous-affinity"} <= set(names):
        aff = [r for r in rows if r["config"] == "continuous-affinity"]
        fifo = [r for r in rows if r["config"] == "continuous-fifo"]
        ratios = [a["decode_tok_s"] / f["decode_tok_s"] for a, f in zip(aff, fifo)]
        trials = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"affinity / fifo decode tok/s: x{statistics.median(ratios):.3f} (trials {trials})")
    if out:
        out.write_text(json.dumps({"rows": rows, "steps": steps}, default=str))


if __name__ == "__main__":
    app()
