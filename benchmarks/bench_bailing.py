"""Decode speed of the bundled runtime against `transformers`' generate() on a `bailing_hybrid`
(Ling-3.0) checkpoint, GSM8K few-shot prompts, one batch, greedy; outputs compared token by token.

    flock /tmp/moebench-bench.lock python benchmarks/bench_bailing.py --model DIR \
        --shots 5 --items 16 --new-tokens 32 --rounds 3 --out docs/measurements/ling3-bench.json

What is timed, the same for every engine: the decode steps of one batch of `--items` requests, each
step from choosing its inputs to choosing its tokens (forward, greedy pick, bookkeeping). Prefill
is not timed, and EOS is ignored so every request decodes `--new-tokens` tokens.
- bundled runtime: `Engine.generate` on the whole batch (its prefill included, untimed); decode
  tok/s = decode tokens / summed durations of its decode steps (the run's own definition).
- transformers: its prefill, with the KDA layers in its chunked PyTorch fallback, materialises
  [batch, heads, chunks, 64, 64, head dim] tensors: at 5-shot and batch 16 that is ~5 GB per tensor,
  more than this machine holds beside the rest. So each prompt is prefilled alone (batch 1, the
  model's own forward with a DynamicCache, its first token the argmax of the last logits, which is
  what greedy generate() picks), and the per-request caches are joined into one batch cache: MLA
  latents left-padded (masked by the attention mask, as generate() pads a batch), KDA recurrent
  and convolution states stacked. generate() then decodes the batch from that cache; its wall time
  covers exactly the remaining `--new-tokens - 1` decode steps. The joined cache reproduces a plain
  batched generate() token for token on a tiny checkpoint (checked in `--self-check`).
  The prefill runs transformers' own token-by-token KDA recurrence (`recurrent_kimi_delta_attention`,
  the function its decode steps use) in place of its chunked fallback (`chunk_kimi_delta_attention`,
  `--hf-prefill chunk`): on a 5-shot prompt of ling3-flash-scaled the chunked fallback's float32 logits
  were 0.12-0.21 away from transformers' own float64 forward (4.3 where a routed expert flipped), the
  recurrent form's 3e-5..5e-5 (docs/models.md), so only the recurrent form gives greedy paths worth
  comparing token by token.
  The prefilled caches are kept in `--hf-cache` (safetensors, keyed by the model and the prompts) so
  that later runs skip the ~20 s per request of the fallback prefill; each round decodes from a fresh
  copy.
Rounds are interleaved (every config once per round, the order rotated per round); figures are
medians over rounds. Each engine config's outputs are compared with transformers' greedy tokens;
where they differ, the first differing position and transformers' logit gap there are reported.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from moebench.ablation import ablation_matrix

# name -> (kernel, scheduler, prefetch): the configs of `moebench run --ablate`; every config runs at
# --expert-budget (lookahead needs one below 1)
CONFIGS = {p.name: (p.kernel, p.scheduler, p.prefetch) for p in ablation_matrix()}
HF = "transformers"


def gsm8k_prompt_ids(model: Path, data: Path, items: int, shots: int) -> list[list[int]]:
    from moebench.engine.loader import load_tokenizer
    from moebench.suites.gsm8k import build_gsm8k_suite
    from moebench.suites.prompts import get_format

    fmt = get_format("gsm8k")
    suite = build_gsm8k_suite("gsm8k", fmt, data=str(data), limit=items, num_fewshot=shots)
    chosen = fmt.choose_fewshot(suite.items, suite.fewshot, shots, exclude_self=False)
    tok = load_tokenizer(model)
    return [tok.encode(fmt.render(item, few)).ids for item, few in zip(suite.items, chosen)]


# ---- transformers: per-request prefill, one joined batch cache, generate() decodes -------------------

def _cache_key(model: Path, prompt_ids) -> str:
    h = hashlib.sha256()
    for f in sorted(model.glob("*.safetensors")) + [model / "config.json"]:
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        h.update(str(f.stat().st_mtime_ns).encode())
    h.update(json.dumps(prompt_ids).encode())
    return h.hexdigest()[:16]


class _RecurrentKdaPrefill:
    """While active, transformers' bailing_hybrid prefill runs its KDA layers with its own
    token-by-token recurrence instead of its chunked float32 fallback (see the module docstring)."""

    def __enter__(self):
        import transformers.models.bailing_hybrid.modeling_bailing_hybrid as modeling

        self.modeling, self.chunked = modeling, modeling.chunk_kimi_delta_attention

        def recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
            return modeling.recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state,
                                                           output_final_state, use_qk_l2norm_in_kernel)

        modeling.chunk_kimi_delta_attention = recurrent
        return self

    def __exit__(self, *exc):
        self.modeling.chunk_kimi_delta_attention = self.chunked


def hf_prefill_each(ref, prompt_ids, cache_dir: Path | None, key: str, mode: str = "recurrent"):
    """Per request: (per-layer cache tensors, first token, its top-2 logit gap). Loaded from
    `cache_dir` when this model and these prompts were prefilled before in this `mode`."""
    import contextlib

    from safetensors.torch import load_file, save_file
    from transformers import DynamicCache

    file = cache_dir / f"hf-prefill-{mode}-{key}.safetensors" if cache_dir else None
    if file is not None and file.is_file():
        flat = load_file(file)
        out = []
        for r in range(len(prompt_ids)):
            prefix = f"r{r}."
            layers = {name[len(prefix):]: t for name, t in flat.items() if name.startswith(prefix)}
            out.append((layers, int(flat[f"first.{r}"]), float(flat[f"gap.{r}"])))
        print(f"transformers prefill: loaded {file}", flush=True)
        return out
    out = []
    for r, ids in enumerate(prompt_ids):
        t = time.perf_counter()
        cache = DynamicCache(config=ref.config)
        with torch.no_grad(), _RecurrentKdaPrefill() if mode == "recurrent" else contextlib.nullcontext():
            logits = ref(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1].float()
        top2 = logits.topk(2).values
        layers = {}
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "recurrent_states", None) is not None and layer.recurrent_states.get(0) is not None:
                layers[f"{i}.recurrent"] = layer.recurrent_states[0].contiguous()
                layers[f"{i}.conv"] = layer.conv_states[0].contiguous()
            else:
                layers[f"{i}.keys"] = layer.keys.contiguous()
                layers[f"{i}.values"] = layer.values.contiguous()
        out.append((layers, int(logits.argmax()), float(top2[0] - top2[1])))
        print(f"transformers prefill {r + 1}/{len(prompt_ids)}: {len(ids)} tokens, {time.perf_counter() - t:.1f} s",
              flush=True)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        flat = {f"r{r}.{name}": t for r, (layers, _, _) in enumerate(out) for name, t in layers.items()}
        flat.update({f"first.{r}": torch.tensor(first) for r, (_, first, _) in enumerate(out)})
        flat.update({f"gap.{r}": torch.tensor(gap) for r, (_, _, gap) in enumerate(out)})
        save_file(flat, str(file))
    return out


def left_padded(prompt_ids, pad_id: int = 0):
    """The prompts as one left-padded batch, as generate() takes them: (ids, attention mask)."""
    L = max(map(len, prompt_ids))
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompt_ids])
    mask = (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in prompt_ids])[:, None]).long()
    return ids, mask


def hf_generate_batched(ref, prompt_ids, new_tokens: int, pad_id: int = 0) -> list[list[int]]:
    """Greedy tokens of one plain batched generate() over the left-padded prompts: what the joined
    per-request caches must reproduce."""
    ids, mask = left_padded(prompt_ids, pad_id)
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad_id)
    return out[:, ids.shape[1]:].tolist()


def hf_join(ref, prefilled, prompt_ids):
    """One batch cache from per-request caches, plus generate()'s inputs: the prompts left-padded
    with each first token appended, and their attention mask."""
    from transformers import DynamicCache

    L = max(map(len, prompt_ids))
    cache = DynamicCache(config=ref.config)
    for i, layer in enumerate(cache.layers):
        if f"{i}.recurrent" in prefilled[0][0]:
            recurrent = torch.cat([p[0][f"{i}.recurrent"] for p in prefilled])
            conv = torch.cat([p[0][f"{i}.conv"] for p in prefilled])
            layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent)
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(recurrent)
            layer.has_previous_state[0] = True
        else:
            def pad(t):
                return torch.nn.functional.pad(t, (0, 0, L - t.shape[-2], 0))
            keys = torch.cat([pad(p[0][f"{i}.keys"]) for p in prefilled])
            values = torch.cat([pad(p[0][f"{i}.values"]) for p in prefilled])
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
    firsts = torch.tensor([p[1] for p in prefilled])[:, None]
    ids, mask = left_padded(prompt_ids)
    ids = torch.cat([ids, firsts], dim=1)
    mask = torch.cat([mask, torch.ones_like(firsts)], dim=1)
    return cache, ids, mask


class _Gaps:
    """A logits processor that keeps each step's top-2 logit gap per row (where a near tie makes a
    greedy path fragile)."""

    def __init__(self):
        self.gaps = []

    def __call__(self, input_ids, scores):
        top2 = scores.float().topk(2, dim=-1).values
        self.gaps.append((top2[:, 0] - top2[:, 1]).tolist())
        return scores


def hf_decode(ref, joined, new_tokens: int, pad_id: int):
    from transformers import LogitsProcessorList

    cache, ids, mask = joined
    cache = copy.deepcopy(cache)
    gaps = _Gaps()
    start = time.perf_counter()
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens - 1,
                           min_new_tokens=new_tokens - 1, do_sample=False, pad_token_id=pad_id,
                           logits_processor=LogitsProcessorList([gaps]))
    seconds = time.perf_counter() - start
    outputs = out[:, ids.shape[1] - 1:].tolist()  # the first token (from the prefill) onwards
    return ids.shape[0] * (new_tokens - 1) / seconds, outputs, gaps.gaps


# ---- bundled runtime -----------------------------------------------------------------------------

def engine_run(ckpt, name: str, prompt_ids, new_tokens: int, budget: float):
    from moebench.engine import Engine, Request, RuntimeConfig

    kernel, scheduler, prefetch = CONFIGS[name]
    rt = RuntimeConfig(batch_size=len(prompt_ids), max_new_tokens=new_tokens, kernel=kernel, scheduler=scheduler,
                       prefetch=prefetch, expert_budget=budget)
    engine = Engine(ckpt, None, rt)
    engine.eos_ids = set()  # every request decodes new_tokens tokens, as transformers' min_new_tokens
    result = engine.generate([Request(f"r{i}", "") for i in range(len(prompt_ids))], prompt_ids=prompt_ids)
    decode = [s for s in result.steps if s["phase"] == "decode"]
    tps = sum(s["decode_tokens"] for s in decode) / sum(s["duration_s"] for s in decode)
    return tps, [c.output_ids for c in result.completions], result.activation_errors


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def self_check() -> None:
    """The joined per-request cache against a plain batched generate() on a tiny checkpoint."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_bailing import make_tiny_bailing
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_bailing(Path(tmp) / "tiny", "g2_ngroup2_topk1")
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (5, 11, 37)]
    plain = hf_generate_batched(ref, prompts, 20)
    joined = hf_join(ref, hf_prefill_each(ref, prompts, None, ""), prompts)
    _, ours, _ = hf_decode(ref, joined, 20, 0)
    same = sum(a == b for a, b in zip(plain, ours))
    print(f"self-check: joined per-request prefill vs batched generate(): {same}/{len(prompts)} identical")
    if same != len(prompts):
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a bailing_hybrid checkpoint (moebench models synth --shape ling3-flash-scaled)")
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("MOEBENCH_GSM8K_DIR", "../shared/data/gsm8k")))
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--items", type=int, default=16, help="requests, all in one batch")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="0: only fill --hf-cache")
    ap.add_argument("--configs", default="baseline,all", help=f"engine configs, of: {', '.join(CONFIGS)}")
    ap.add_argument("--expert-budget", type=float, default=1.0, help="for every engine config (lookahead needs < 1)")
    ap.add_argument("--no-hf", action="store_true", help="engine configs only (outputs compared with the first)")
    ap.add_argument("--hf-cache", type=Path, default=Path.home() / ".cache" / "moebench" / "bench_bailing")
    ap.add_argument("--hf-prefill", choices=["recurrent", "chunk"], default="recurrent",
                    help="transformers' KDA form for the (untimed) prefill; chunk is its imprecise float32 fallback")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both engines")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--self-check", action="store_true", help="check the joined transformers cache on a tiny model and exit")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.self_check:
        self_check()
        return
    if args.model is None:
        ap.error("--model is required")
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")

    from moebench.engine import load_checkpoint

    prompt_ids = gsm8k_prompt_ids(args.model, args.data, args.items, args.shots)
    lengths = sorted(map(len, prompt_ids))
    print(f"{len(prompt_ids)} prompts, {args.shots}-shot, {lengths[0]}-{lengths[-1]} tokens", flush=True)
    ckpt = load_checkpoint(args.model, experts_in_checkpoint_dtype=args.expert_budget < 1)
    pad_id = 0
    hf_gaps_prefill = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        pad_id = ref.config.pad_token_id or 0
        prefilled = hf_prefill_each(ref, prompt_ids, args.hf_cache, _cache_key(args.model, prompt_ids),
                                    args.hf_prefill)
        hf_gaps_prefill = [p[2] for p in prefilled]
        joined = hf_join(ref, prefilled, prompt_ids)
        names = [HF] + names

    if args.rounds == 0:  # transformers' prefill cache filled; nothing timed
        return
    rows = {n: [] for n in names}
    outputs, errors, hf_gaps = {}, {}, None
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            load = os.getloadavg()[0]
            t = time.perf_counter()
            if name == HF:
                tps, outs, gaps = hf_decode(ref, joined, args.new_tokens, pad_id)
                hf_gaps = hf_gaps or gaps
            else:
                tps, outs, errs = engine_run(ckpt, name, prompt_ids, args.new_tokens, args.expert_budget)
                errors.setdefault(name, errs)
            outputs.setdefault(name, outs)
            if outs != outputs[name]:
                print(f"  {name}: outputs changed between rounds", flush=True)
            rows[name].append(tps)
            print(f"round {r} {name}: {tps:.2f} decode tok/s (load {load:.2f}, {time.perf_counter() - t:.0f} s)",
                  flush=True)

    reference = names[0]
    result = {"model": str(args.model), "hf_prefill": None if args.no_hf else args.hf_prefill, "shots": args.shots, "items": len(prompt_ids), "prompt_tokens":
              [lengths[0], lengths[-1]], "new_tokens": args.new_tokens, "rounds": args.rounds,
              "threads": args.threads, "expert_budget": args.expert_budget, "reference": reference,
              "load_after": os.getloadavg()[0], "configs": {}}
    ref_med = statistics.median(rows[reference])
    for name in names:
        med = statistics.median(rows[name])
        diffs = []
        for i, (a, b) in enumerate(zip(outputs[name], outputs[reference])):
            pos = first_difference(a, b)
            if pos is not None:
                gap = None
                if hf_gaps is not None:  # transformers' top-2 gap where the paths part
                    gap = hf_gaps_prefill[i] if pos == 0 else hf_gaps[pos - 1][i]
                diffs.append({"item": i, "position": pos, "reference_token": b[pos], "token": a[pos],
                              "reference_top2_gap": gap})
        result["configs"][name] = {
            "switches": None if name == HF else dict(zip(("kernel", "scheduler", "prefetch"), CONFIGS[name])),
            "decode_tokens_per_s": rows[name], "median": med, "vs_reference": med / ref_med,
            "identical_outputs": len(prompt_ids) - len(diffs), "differences": diffs,
            "activation_errors": errors.get(name, []),
        }
        print(f"{name:>18}: median {med:7.2f} decode tok/s, {med / ref_med:5.2f}x {reference}, identical "
              f"{len(prompt_ids) - len(diffs)}/{len(prompt_ids)}" + (f", differences {diffs}" if diffs else "")
              + (f", ACTIVATION ERRORS {errors[name]}" if errors.get(name) else ""), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
