"""Scheduler benchmark: static vs continuous batching (fifo and affinity admission), interleaved in
one process so that a shared machine's drift hits every configuration alike.

    python -m moebench.bench_scheduler make-model /tmp/rand-moe          # random qwen3_moe + BPE
    python -m moebench.bench_scheduler bench --model /tmp/rand-moe --data ../shared/data/gsm8k \
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
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    texts = []
    with open(data / "train.jsonl") as f:
        for line in f:
            row = json.loads(line)
            texts.append(row["question"] + "\n" + row["answer"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=width, intermediate_size=4 * width, norm_topk_prob=True, max_position_embeddings=4096,
        eos_token_id=None, pad_token_id=None, bos_token_id=None, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e6:.1f}M parameters, tokenizer vocab {tok.get_vocab_size()}")


def _percentile(values, q):
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return float("nan")
    idx = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
    return values[idx]


def _metrics(result, request_arrival_waits, full: int) -> dict:
    decode = [s for s in result.steps if s["phase"] == "decode"]
    tokens = sum(s["decode_tokens"] for s in decode)
    seconds = sum(s["duration_s"] for s in decode)
    return {
        "decode_tok_s": tokens / seconds if seconds else float("nan"),
        "decode_tokens": tokens,
        "decode_s": seconds,
        "decode_steps": len(decode),
        "mean_batch": statistics.fmean(s["batch_size"] for s in decode) if decode else 0.0,
        "distinct_experts": statistics.fmean(s["distinct_experts"] for s in decode) if decode else 0.0,
        # batch size drives distinct experts; compare policies on full-batch steps too
        "distinct_full": statistics.fmean([s["distinct_experts"] for s in decode if s["batch_size"] == full] or [float("nan")]),
        "wall_s": result.wall_s,
        "queue_wait_p95_s": _percentile(request_arrival_waits, 0.95),
        "queue_wait_mean_s": statistics.fmean(request_arrival_waits),
        # a request prefilled ahead may still wait for a decode slot: the time to its second token
        # shows that wait, whatever the admission counted as "queue"
        "second_token_p95_s": _percentile([c.token_times[1] for c in result.completions if len(c.token_times) > 1], 0.95),
        "latency_p95_s": _percentile([c.latency_s for c in result.completions], 0.95),
        "latency_mean_s": statistics.fmean(c.latency_s for c in result.completions),
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
    out: Optional[Path] = typer.Option(None, help="Write per-trial metrics as JSON here."),
):
    import torch

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
          f"(min {min(r.max_new_tokens for r in requests)}, max {max(r.max_new_tokens for r in requests)})")
    names = configs.split(",")
    base = RuntimeConfig(batch_size=batch_size, max_new_tokens=max_new_tokens, kernel=kernel)
    rows, outputs = [], {}
    # warm-up: a few requests per config (allocator, caches), not measured
    for name in names:
        Engine(ckpt, tokenizer, replace(base, **CONFIGS[name])).generate(requests[:2], prompt_ids=[p[:64] for p in prompt_ids[:2]])
    for trial in range(repeats):
        for name in names:
            runtime = replace(base, **CONFIGS[name])
            engine = Engine(ckpt, tokenizer, runtime)
            result = engine.generate(requests, prompt_ids=prompt_ids)
            # every request arrives at once, so all requests admitted in one step waited the same:
            # the step's mean queue wait, once per request it admitted
            waits = [s["queue_wait_s"] for s in result.steps if not math.isnan(s["queue_wait_s"])
                     for _ in range(s["batch_size"])]
            m = _metrics(result, waits, batch_size)
            m.update(config=name, trial=trial, evidence=result.evidence["scheduler"], errors=result.activation_errors)
            rows.append(m)
            outputs.setdefault(name, []).append([c.output_ids for c in result.completions])
            print(f"{name:>20} #{trial}: decode {m['decode_tok_s']:7.1f} tok/s  batch {m['mean_batch']:5.2f}  "
                  f"distinct {m['distinct_experts']:5.2f} (full {m['distinct_full']:5.2f})  wait p95 {m['queue_wait_p95_s']:6.2f}s  "
                  f"2nd-token p95 {m['second_token_p95_s']:6.2f}s  latency p95 {m['latency_p95_s']:6.2f}s  "
                  f"wall {m['wall_s']:6.1f}s  {json.dumps(m['evidence'])}", flush=True)
    print()
    ref = outputs[names[0]][0]
    for name in names:
        med = {k: statistics.median(r[k] for r in rows if r["config"] == name)
               for k in ("decode_tok_s", "distinct_experts", "queue_wait_p95_s", "mean_batch", "wall_s",
                         "second_token_p95_s", "latency_p95_s", "distinct_full")}
        same = statistics.fmean(a == b for outs in outputs[name] for a, b in zip(outs, ref))
        ratios = [r["decode_tok_s"] / b["decode_tok_s"] for r, b in
                  zip([r for r in rows if r["config"] == name], [r for r in rows if r["config"] == names[0]])]
        print(f"{name:>20}: decode {med['decode_tok_s']:7.1f} tok/s (x{statistics.median(ratios):.2f} vs {names[0]}, "
              f"per trial {', '.join(f'{x:.2f}' for x in ratios)})  distinct/layer/step {med['distinct_experts']:5.2f}  "
              f"(at full batch {med['distinct_full']:5.2f})  queue wait p95 {med['queue_wait_p95_s']:6.2f}s  "
              f"2nd-token p95 {med['second_token_p95_s']:6.2f}s  latency p95 {med['latency_p95_s']:6.2f}s  "
              f"mean batch {med['mean_batch']:5.2f}  wall {med['wall_s']:6.1f}s  "
              f"identical to {names[0]} {100 * same:.1f}%")
    if out:
        out.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    app()
