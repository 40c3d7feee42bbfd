"""How much of the expert-offload penalty prefetch=lookahead hides.

    python benchmarks/bench_prefetch.py [--model DIR] [--budget 0.5] [--batch 1,16] [--repeats 3]

Measures decode time per token, at each batch size and on the same prompts, for:
  resident              every expert in the fast pool (budget 1.0)            -> T_resident
  resident/lookahead    budget 1.0 with the prefetcher switched on (idle: its cost)
  <tier>/off            budget < 1, misses loaded on demand, one at a time    -> T_off
  <tier>/lookahead      budget < 1, next layer's experts predicted and loaded
                        in the background                                      -> T_lookahead
for the host and disk tiers (with `--store both`, each tier once per expert store: `host:python`,
`host:native`, ...), trials interleaved (every batch size and config once, then again) so
drift on a shared machine hits each alike. The hidden share is
    (T_off - T_lookahead) / (T_off - T_resident)
per tier, computed within each repeat (paired) and reported as the median over repeats; speedups
are medians of paired ratios too. T_off / T_resident bounds what any prefetch can gain. Every
offloaded run must produce exactly the resident run's tokens; a mismatch is an error.

Default model: the bundled gsm-synth MoE if present, else a random qwen3_moe (hidden 512, 8 layers,
64 experts top-8, expert width 512, initializer range 0.15, bfloat16) written once with transformers into --workdir.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

RANDOM_MODEL = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                    moe_intermediate_size=512, intermediate_size=1024, norm_topk_prob=True,
                    max_position_embeddings=2048, tie_word_embeddings=False,
                    # At transformers' default 0.02 a random model repeats one token forever, so every
                    # decode step routes to the same experts and there is no offload penalty to hide;
                    # at 0.15 it emits varied tokens and routing changes from token to token.
                    initializer_range=0.15)


def random_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A random bfloat16 qwen3_moe saved by transformers itself (the files the engine loads in the field)."""
    if (directory / "config.json").exists() and any(directory.glob("*.safetensors")):
        return directory
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(eos_token_id=None, pad_token_id=None, bos_token_id=None, **RANDOM_MODEL)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


STORES = ("auto", "native", "python", "both")


def _tier_labels(tiers: list[str], store: str) -> list[str]:
    """One label per measured tier: the tier itself, or `tier:store` per store with --store both."""
    return [f"{t}:{s}" for t in tiers for s in ("python", "native")] if store == "both" else list(tiers)


def _configs(budget, labels):
    yield "resident", dict(expert_budget=1.0, prefetch="off")
    # With every expert resident the prefetcher must cost (almost) nothing: measured, not assumed.
    yield "resident/lookahead", dict(expert_budget=1.0, prefetch="lookahead")
    for label in labels:
        tier, _, store = label.partition(":")
        for prefetch in ("off", "lookahead"):
            yield f"{label}/{prefetch}", dict(expert_budget=budget, offload_tier=tier, prefetch=prefetch,
                                              **({"store": store} if store else {}))


def _run(engine_cls, ckpt, prompts, runtime):
    from moebench.engine import Request

    cpu0, wall0 = os.times(), time.perf_counter()
    result = engine_cls(ckpt, None, runtime).generate([Request(f"b{i}", "") for i in range(len(prompts))],
                                                      prompt_ids=prompts)
    cpu1, wall1 = os.times(), time.perf_counter()
    decode = [s for s in result.steps if s["phase"] == "decode"]
    tokens = sum(s["decode_tokens"] for s in decode)
    seconds = sum(s["duration_s"] for s in decode)
    hits, misses = (sum(s.get(k, 0) for s in decode) for k in ("expert_hits", "expert_misses"))
    result.decode_stats = {"stall_ms_per_token": 1e3 * sum(s.get("stall_s", 0.0) for s in decode) / tokens,
                           "decode_hit_rate": hits / (hits + misses) if hits + misses else None,
                           "decode_bytes_loaded": sum(s.get("bytes_loaded", 0) for s in decode),
                           # CPU seconds of this process per wall second: ~1 when the loader threads
                           # found no idle core (their work then competes with the model's thread)
                           "cores_used": (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / (wall1 - wall0)}
    return [c.output_ids for c in result.completions], seconds / tokens, result


def _prompts(args, batch: int, path: Path, ckpt) -> list[list[int]]:
    """Real prompts where the model can read them (a trained model routes real text differently
    from noise), else random ids."""
    use_suite = args.prompts == "suite" or (args.prompts == "auto" and (path / "tokenizer.json").exists())
    if use_suite:
        from moebench.engine.loader import load_tokenizer
        from moebench.suites import load_suite

        tokenizer = load_tokenizer(path)
        suite = load_suite("gsm-synth", None, batch)
        return [tokenizer.encode(suite.prompt(item)).ids for item in suite.items[:batch]]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, ckpt.config.vocab_size, (args.prompt_len,), generator=g).tolist()
            for _ in range(batch)]


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _ratio_or_none(a, b):
    return a / b if a is not None and b else None


def _mb(n):
    return None if n is None else n / 1e6


def _paired_ci(num: list[float], den: list[float]) -> list[float] | None:
    """95% t interval of the paired per-repeat ratios num/den (on their logs, as `moebench run` does)."""
    from moebench.results import stats

    if len(num) < 2:
        return None
    _, ci = stats.trial_interval([a / b for a, b in zip(num, den)])
    return [float(ci[0]), float(ci[1])]


def _median_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def _summarise(batch: int, names: list[str], tiers: list[str], times: dict, stalls: dict, cores: dict,
               evidence: dict) -> dict:
    """Print one batch size's table and ratios; return them for --json."""
    out = {"configs": {}, "tiers": {}}
    print(f"\nbatch {batch}: median decode time per token")
    print(f"{'config':23s} {'ms/token':>9s} {'tok/s':>7s} {'hit rate':>8s} {'prefetch':>9s} "
          f"{'pf prec':>7s} {'pred P':>6s} {'pred R':>6s} {'decode hit':>10s} {'stall ms/tok':>12s} {'loaded MB':>9s} "
          f"{'cores':>5s} {'expert MB':>9s} {'of res.':>7s}")
    for name in names:
        t = statistics.median(times[name])
        ev = evidence[name]
        row = {"ms_per_token": t * 1e3, "tokens_per_s": 1 / t,
               "ms_per_token_trials": [x * 1e3 for x in times[name]],
               **{k: ev.get(k) for k in ("store", "hit_rate", "prefetch_issued", "prefetch_hits",
                                         "prefetch_precision",
                                         "prediction_precision", "prediction_recall", "stall_s", "read_mode",
                                         "decode_hit_rate", "decode_bytes_loaded", "bytes_loaded")},
               "expert_memory_bytes": ev.get("expert_memory_bytes"),
               "expert_memory_vs_resident": _ratio_or_none(ev.get("expert_memory_bytes"),
                                                           evidence["resident"].get("expert_memory_bytes")),
               "decode_stall_ms_per_token": statistics.median(stalls[name]),
               "cores_used": statistics.median(cores[name])}
        out["configs"][name] = row
        print(f"{name:23s} {t * 1e3:9.2f} {1 / t:7.1f} {_fmt(ev.get('hit_rate'), '8.1%')} "
              f"{_fmt(ev.get('prefetch_hits'), '4d')}/{_fmt(ev.get('prefetch_issued'), '<4d')} "
              f"{_fmt(ev.get('prefetch_precision'), '7.1%')} {_fmt(ev.get('prediction_precision'), '6.1%')} "
              f"{_fmt(ev.get('prediction_recall'), '6.1%')} {_fmt(ev.get('decode_hit_rate'), '10.1%')} "
              f"{statistics.median(stalls[name]):12.2f} {ev.get('decode_bytes_loaded', 0) / 1e6:9.2f} "
              f"{statistics.median(cores[name]):5.2f} {_fmt(_mb(ev.get('expert_memory_bytes')), '9.2f')} "
              f"{_fmt(row['expert_memory_vs_resident'], '7.0%')}")
    cost = _median_ratio(times["resident/lookahead"], times["resident"]) - 1
    out["budget_1_lookahead_cost"] = cost
    print(f"budget 1.0: lookahead costs {cost:+.1%} decode time vs off (median of paired repeats); "
          f"bytes loaded in decode: {evidence['resident/lookahead'].get('decode_bytes_loaded', 0)}")
    for tier in tiers:
        res, off, la = times["resident"], times[f"{tier}/off"], times[f"{tier}/lookahead"]
        # a pair where off was not slower than resident has no penalty to share: it is left out of
        # the median (a median over a list holding nan is arbitrary)
        shares = [(o - a) / (o - r) if o > r else float("nan") for r, o, a in zip(res, off, la)]
        defined = [x for x in shares if x == x]
        share = statistics.median(defined) if defined else float("nan")
        mr, mo, ml = (statistics.median(x) for x in (res, off, la))
        of_medians = (mo - ml) / (mo - mr) if mo > mr else float("nan")
        speedup = _median_ratio(off, la)
        ci = _paired_ci(off, la)
        out["tiers"][tier] = {"hidden_share": share, "hidden_share_trials": shares,
                              "hidden_share_of_medians": of_medians, "speedup_vs_off": speedup,
                              "speedup_vs_off_ci95": ci,
                              "expert_memory_vs_resident": out["configs"][f"{tier}/lookahead"]["expert_memory_vs_resident"],
                              "off_vs_resident": _median_ratio(off, res),
                              "prediction_recall": evidence[f"{tier}/lookahead"].get("prediction_recall")}
        print(f"{tier}: lookahead {speedup:.2f}x decode vs off "
              f"{'' if ci is None else f'[{ci[0]:.2f}, {ci[1]:.2f}] '}"
              f"(off is {_median_ratio(off, res):.2f}x resident's time), "
              f"hides {share:.1%} of the offload penalty (paired repeats: {', '.join(f'{s:.0%}' for s in shares)}"
              f"{'; undefined where off was not slower than resident' if len(defined) < len(shares) else ''}; "
              f"from the median times: {of_medians:.1%}); prediction recall "
              f"{_fmt(evidence[f'{tier}/lookahead'].get('prediction_recall'), '.1%')}")
    return out


def main(argv=None) -> int:
    from dataclasses import replace

    from moebench.engine import Engine, RuntimeConfig, load_checkpoint
    from moebench.engine.config import StoreTuning
    from moebench.errors import MoebenchError
    from moebench.measuring.run import bundled_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "moebench" / "bench-qwen3moe-h512-l8-e64k8-init0.15")
    ap.add_argument("--budget", default="0.5")
    ap.add_argument("--tiers", default="host,disk")
    ap.add_argument("--batch", default="1,16", help="batch sizes, comma-separated (each measured in the same run)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernel", default="naive")
    ap.add_argument("--prompts", choices=("auto", "suite", "random"), default="auto",
                    help="suite: the first --batch gsm-synth items (needs the model's tokenizer.json); random: "
                         "random token ids; auto: suite when the model has a tokenizer")
    ap.add_argument("--readers", type=int, default=StoreTuning().readers,
                    help="parallel readers of the disk tier (off and lookahead alike; default: the runtime's)")
    ap.add_argument("--lookahead-extra", type=int, default=1,
                    help="experts predicted per token beyond top-k (the first MoE layer: one more)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1 leaves a core to the loader threads; 2 OpenMP threads on a "
                         "busy 2-core machine stall on each other)")
    ap.add_argument("--store", choices=STORES, default="auto",
                    help="the expert store of the offloaded configs: auto (native on CPU where it can run), native, "
                         "python (the reference PooledStore), or both (each tier measured with each)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in str(args.batch).split(",") if b]

    try:
        path = args.model or (bundled_model_path() if bundled_model_path().exists() else random_checkpoint(args.workdir))
        t0 = time.perf_counter()
        ckpt = load_checkpoint(path)
        # Each tier on the checkpoint it gets in a run (harness/measuring/run.py): the host tier's experts in the
        # file's dtype, the disk tier's left in the files, so each config's expert memory is its own.
        ckpts = {"resident": ckpt, "host": load_checkpoint(path, experts_in_checkpoint_dtype=True),
                 "disk": load_checkpoint(path, experts_in_checkpoint_dtype=True, load_experts=False)}
        print(f"model {path} ({ckpt.config.num_layers} layers, {ckpt.config.num_experts} experts top-"
              f"{ckpt.config.top_k}, {ckpt.checkpoint_dtype}) loaded in {time.perf_counter() - t0:.1f}s", flush=True)
        tiers = _tier_labels([t for t in args.tiers.split(",") if t], args.store)
        names = [name for name, _ in _configs(args.budget, tiers)]
        runs = []  # (batch, name, prompts, runtime): one trial of each per repeat, interleaved
        for b in batches:
            prompts = _prompts(args, b, path, ckpt)
            tuning = StoreTuning(readers=args.readers, lookahead_extra=args.lookahead_extra)
            if args.store != "both":
                tuning = replace(tuning, expert_store=args.store)
            base = RuntimeConfig(kernel=args.kernel, batch_size=b, max_new_tokens=args.new_tokens, store=tuning)
            for name, kw in _configs(args.budget, tiers):
                store = kw.pop("store", None)
                rt = replace(base, **kw)
                runs.append((b, name, prompts, replace(rt, store=replace(tuning, expert_store=store)) if store else rt))

        def ckpt_for(rt):
            return ckpts["resident"] if rt.expert_budget in (1, 1.0) else ckpts[rt.offload_tier]

        for _, _, prompts, rt in runs:  # warm-up: caches, lazy inits, the disk tier's first opens
            _run(Engine, ckpt_for(rt), prompts, replace(rt, max_new_tokens=2))
        times = {(b, n): [] for b, n, _, _ in runs}
        stalls = {(b, n): [] for b, n, _, _ in runs}
        cores = {(b, n): [] for b, n, _, _ in runs}
        evidence, reference = {}, {}
        for rep in range(args.repeats):
            for b, name, prompts, rt in runs:
                out, per_token, result = _run(Engine, ckpt_for(rt), prompts, rt)
                reference.setdefault(b, out)
                if out != reference[b]:
                    raise MoebenchError(f"batch {b} {name}: output differs from the resident store's "
                                        "(offloading must be exact)")
                errors = result.activation_errors
                if name == "resident/lookahead":  # idle on purpose: this config measures an idle prefetcher's cost
                    errors = [e for e in errors if "nothing to prefetch" not in e]
                if errors:
                    raise MoebenchError(f"batch {b} {name}: {'; '.join(errors)}")
                times[b, name].append(per_token)
                stalls[b, name].append(result.decode_stats["stall_ms_per_token"])
                cores[b, name].append(result.decode_stats["cores_used"])
                evidence[b, name] = {**result.evidence["prefetch"], **result.decode_stats}
                print(f"  repeat {rep} batch {b:3d} {name:23s} {per_token * 1e3:8.2f} ms/token", flush=True)
    except MoebenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    report = {"model": str(path), "budget": args.budget, "store": args.store, "new_tokens": args.new_tokens,
              "threads": args.threads,
              "kernel": args.kernel, "load_average": os.getloadavg(), "batches": {}}
    print(f"\nbudget {args.budget}, {args.new_tokens} new tokens, {args.repeats} repeats, kernel {args.kernel}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("(hit rate, prefetch and prediction columns: the whole last run, prefill included; decode hit, stall and "
          "loaded MB: decode steps only; cores: CPU seconds of this process per wall second of a trial)")
    for b in batches:
        pick = lambda d: {n: d[b, n] for n in names}  # noqa: E731
        report["batches"][str(b)] = _summarise(b, names, tiers, pick(times), pick(stalls), pick(cores), pick(evidence))
    if args.json:
        from moebench.fileio import atomic_write_json

        atomic_write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
