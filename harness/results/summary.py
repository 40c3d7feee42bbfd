"""summary.json: every number the report and the gate need, computed once from a results dir.

build_summary(run_dir) reads manifest.json, samples.jsonl, trials.jsonl and steps.parquet
(format: docs/results-format.md). trials.jsonl and steps.parquet are optional: what they
feed becomes null. verdict(summary) turns one config's comparison into a plain sentence.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moebench.results import stats
from moebench.errors import MoebenchError
from moebench.fileio import read_json
from moebench.results.paired_accuracy import paired_difference, tango_interval
from moebench.results.policy import DEFAULTS
from moebench.results.run_data import RunData, is_error, load_run, per_item  # noqa: F401  (re-exported: callers read runs through here)
from moebench.results.verdict import config_entry, format_p, judge_accuracy, verdict  # noqa: F401  (re-exported)

SCHEMA = "moebench.summary/1"
FIRST_DIVERGENCE_CAP = 50


# ---------------------------------------------------------------- small helpers

def _num(df: pd.DataFrame | None, col: str) -> pd.Series | None:
    if df is None or col not in df:
        return None
    return pd.to_numeric(df[col], errors="coerce")


def _mean(df: pd.DataFrame | None, col: str) -> float | None:
    s = _num(df, col)
    if s is None or s.dropna().empty:
        return None
    return float(s.dropna().mean())


def _sum(df: pd.DataFrame | None, col: str) -> float | None:
    s = _num(df, col)
    if s is None or s.dropna().empty:
        return None
    return float(s.dropna().sum())


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _config_steps(run: RunData, name: str) -> pd.DataFrame | None:
    if run.steps is None:
        return None
    df = run.steps[run.steps["config"] == name]
    return df if not df.empty else None


def _decode_steps(steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """Steps that generated tokens outside a pure prefill step (decode and mixed)."""
    if steps is None or "decode_tokens" not in steps or "duration_s" not in steps:
        return None
    mask = pd.to_numeric(steps["decode_tokens"], errors="coerce").fillna(0) > 0
    if "phase" in steps:
        mask &= steps["phase"].astype(str) != "prefill"
    df = steps[mask]
    return df if not df.empty else None


# ---------------------------------------------------------------- throughput

# The two throughputs a summary reports for every config, each from its per-trial rates:
#   decode: tokens generated in decode steps / wall time of those steps (prefill steps left out);
#   output: every output token / the trial's whole wall time, `vllm bench serve`'s "output token
#           throughput" (nothing left out: prefill, scheduling and waits all count).
METRICS = {"decode": ("decode_tokens", "decode_s"), "output": ("output_tokens", "wall_s")}
METRIC_LABELS = {"decode": "decode tok/s", "output": "output tok/s (whole run)"}
COUNTS = {**METRICS, "requests": ("completed_requests", "wall_s")}  # reported, never compared


def _trial_rates(run: RunData, name: str, metric: str = "decode") -> dict[int, float]:
    """Rate per trial from trials.jsonl; decode rates, without trials.jsonl, from summed steps."""
    tok_col, sec_col = COUNTS[metric]
    rates: dict[int, float] = {}
    if run.trials is not None and {tok_col, sec_col} <= set(run.trials.columns):
        t = run.trials[run.trials["config"] == name]
        for trial, tok, sec in zip(t["trial"], _num(t, tok_col), _num(t, sec_col)):
            if pd.notna(tok) and pd.notna(sec) and sec > 0:
                rates[int(trial)] = float(tok) / float(sec)
        if rates:
            return rates
    dec = _decode_steps(_config_steps(run, name)) if metric == "decode" else None
    if dec is not None:
        for trial, g in dec.groupby("trial"):
            sec = float(_num(g, "duration_s").sum())
            if sec > 0:
                rates[int(trial)] = float(_num(g, "decode_tokens").sum()) / sec
    return rates


# ---------------------------------------------------------------- samples

def _accuracy(samples: pd.DataFrame, items: pd.DataFrame, name: str) -> dict:
    correct, total = int(items["correct"].sum()), int(len(items))
    mine = samples[samples["config"] == name]
    per_trial = {int(t): int(g["correct"].sum()) for t, g in mine.groupby("trial")}
    # Trials agree when every item has one output text across all trials that ran it.
    agree = bool((mine.groupby("item_id")["output"].nunique() <= 1).all())
    return {"correct": correct, "total": total,
            "value": correct / total if total else None,
            "ci95": stats.finite_interval(stats.wilson_ci(correct, total)),
            "trials_agree": agree,
            "correct_per_trial": [per_trial[t] for t in sorted(per_trial)]}


def _latency(samples: pd.DataFrame) -> dict:
    ok = samples[samples["error"].isna()] if "error" in samples else samples
    out = {}
    for col in ("ttft_s", "tpot_s", "latency_s"):
        out[col] = stats.percentiles(_num(ok, col).dropna().to_numpy() if col in ok else [])
    itl: list[float] = []
    for v in ok["itl_s"]:
        if isinstance(v, (list, tuple, np.ndarray)):
            itl.extend(float(x) for x in v if x is not None)
    out["itl_s"] = stats.percentiles(itl)
    return out


# ---------------------------------------------------------------- steps and trials

def _batching(steps: pd.DataFrame | None) -> dict:
    dec = _decode_steps(steps)
    qw = _num(steps, "queue_wait_s")
    qw = qw.dropna() if qw is not None else None
    return {
        "mean_batch_size": _mean(dec, "batch_size"),
        "mean_distinct_experts": _mean(dec, "distinct_experts"),
        "mean_expert_imbalance": _mean(dec, "expert_imbalance"),
        "p95_queue_wait_s": float(np.percentile(qw, 95)) if qw is not None and not qw.empty else None,
    }


def _expert_store(steps: pd.DataFrame | None) -> dict:
    n_trials = steps["trial"].nunique() if steps is not None else 0
    hits, misses = _sum(steps, "expert_hits"), _sum(steps, "expert_misses")
    issued, phits = _sum(steps, "prefetch_issued"), _sum(steps, "prefetch_hits")
    stall, dur = _sum(steps, "stall_s"), _sum(steps, "duration_s")
    loaded = _sum(steps, "bytes_loaded")
    return {
        "hit_rate": _ratio(hits, (hits or 0) + (misses or 0)) if hits is not None else None,
        "prefetch_issued": issued,
        "prefetch_hits": phits,
        # Only derivable once something was prefetched.
        "prefetch_precision": _ratio(phits, issued) if issued else None,
        # Totals are per trial so that runs with different repeat counts compare.
        "bytes_loaded": _ratio(loaded, n_trials),
        "stall_s": _ratio(stall, n_trials),
        "stall_share": _ratio(stall, dur),
    }


def _memory(run: RunData, name: str) -> dict:
    """Expert memory (every expert byte the store held: pool or resident experts, any host copy,
    read buffers) and the process's peak RSS during each trial, from the store's evidence in
    trials.jsonl; the largest over the config's trials."""
    keys = ("expert_memory_bytes", "expert_pool_bytes", "host_copy_bytes", "read_buffer_bytes",
            "process_rss_peak_bytes")
    out: dict[str, Any] = dict.fromkeys(keys)
    out.update(tier=None, read_mode=None, expert_budget=None)
    if run.trials is None or "evidence" not in run.trials:
        return out
    for ev in run.trials[run.trials["config"] == name]["evidence"]:
        pf = (ev or {}).get("prefetch") if isinstance(ev, dict) else None
        if not isinstance(pf, dict):
            continue
        for k in keys:
            if isinstance(pf.get(k), (int, float)):
                out[k] = max(out[k] or 0, pf[k])
        out["tier"] = pf.get("tier", "none (all resident)" if pf.get("store") == "resident" else None)
        out["read_mode"] = pf.get("read_mode")
        out["expert_budget"] = pf.get("expert_budget")
    return out


def _offload_tradeoff(configs: list[dict], rates: dict, base: str) -> dict | None:
    """All-resident vs offloaded without prefetch (the baseline) vs offloaded with lookahead (the
    `prefetch` config): expert memory, decode tok/s, and the share of the offload penalty lookahead
    hides, (T_off - T_lookahead) / (T_off - T_resident) with T = 1 / decode tok/s, per trial (the
    three ran in the same trial) and its median."""
    from moebench.ablation import RESIDENT

    by_name = {c["name"]: c for c in configs}
    if RESIDENT not in by_name or "prefetch" not in by_name or base not in by_name:
        return None
    res, off, la = (rates[n] for n in (RESIDENT, base, "prefetch"))
    shares = []
    for t in sorted(set(res) & set(off) & set(la)):
        t_res, t_off, t_la = 1 / res[t], 1 / off[t], 1 / la[t]
        shares.append((t_off - t_la) / (t_off - t_res) if t_off > t_res else None)
    defined = [x for x in shares if x is not None]
    resident_bytes = by_name[RESIDENT]["memory"]["expert_memory_bytes"]

    def point(name):
        c = by_name[name]
        mem = c["memory"]["expert_memory_bytes"]
        return {"config": name, "expert_memory_bytes": mem,
                "expert_memory_vs_resident": _ratio(mem, resident_bytes),
                "process_rss_peak_bytes": c["memory"]["process_rss_peak_bytes"],
                "decode_tokens_per_s": c["decode_tokens_per_s"]["median"],
                "tier": c["memory"]["tier"], "read_mode": c["memory"]["read_mode"]}

    return {"resident": point(RESIDENT), "off": point(base), "lookahead": point("prefetch"),
            "penalty_hidden": float(np.median(defined)) if defined else None,
            "penalty_hidden_trials": shares}


def _roofline(steps: pd.DataFrame | None, bandwidth_gb_s: float | None,
              achieved: float | None) -> dict:
    dec = _decode_steps(steps)
    bytes_per_step = _mean(dec, "bytes_read")
    limit = None
    if dec is not None and bytes_per_step is not None and bandwidth_gb_s:
        need_s = float((_num(dec, "bytes_read").fillna(0) / (bandwidth_gb_s * 1e9)).sum())
        limit = _ratio(float(_num(dec, "decode_tokens").sum()), need_s)
    return {"bytes_per_decode_step": bytes_per_step,
            "memory_read_gb_s": bandwidth_gb_s,
            "limit_tokens_per_s": limit,
            "achieved_fraction": _ratio(achieved, limit)}


def _trial0(run: RunData, name: str) -> dict | None:
    if run.trials is None:
        return None
    t = run.trials[run.trials["config"] == name]
    return t.iloc[0].to_dict() if not t.empty else None


def _activation(run: RunData, name: str) -> dict:
    unknown = {"ok": None, "status": "unknown", "not_exercised": [], "evidence": None, "errors": []}
    if run.trials is None:
        return unknown
    t = run.trials[run.trials["config"] == name]
    if t.empty:
        return unknown
    if "activation_ok" in t:
        # A trial that does not say it activated counts as not activated.
        ok: bool | None = all(f is True or f == 1 for f in t["activation_ok"].tolist())
    else:
        ok = None  # the orchestrator recorded no verdict at all: unknown, not failed
    errors: list[str] = []
    for trial, errs in zip(t["trial"], t["activation_errors"] if "activation_errors" in t else []):
        for e in errs if isinstance(errs, list) else []:
            msg = f"trial {trial}: {e}"
            if msg not in errors:
                errors.append(msg)
    # A switch whose evidence depends on the workload (continuous batching's mid-flight admission
    # needs more requests than slots) may have had nothing to do: "not exercised", never "ok".
    idle: list[str] = []
    for errs in t["not_exercised"] if "not_exercised" in t else []:
        for e in errs if isinstance(errs, list) else []:
            if e not in idle:
                idle.append(e)
    status = {None: "unknown", False: "failed"}.get(ok, "not exercised" if idle else "ok")
    evidence = t.iloc[0].get("evidence")
    return {"ok": ok, "status": status, "not_exercised": idle,
            "evidence": evidence if isinstance(evidence, dict) else None, "errors": errors}


# ---------------------------------------------------------------- comparison

def _first_diff(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _accuracy_difference(samples: pd.DataFrame, name: str, base: str) -> dict:
    """Config - baseline over every (item, trial) pair both answered, clustered by item (the
    unit under sampling), in points: moebench.results.paired_accuracy.paired_difference."""
    cols = ["item_id", "trial", "correct", "output"]
    pair = samples[samples["config"] == base][cols].merge(
        samples[samples["config"] == name][cols], on=["item_id", "trial"], suffixes=("_b", "_c"))
    d = paired_difference(pd.factorize(pair["item_id"])[0], pair["correct_b"].to_numpy(bool),
                          pair["correct_c"].to_numpy(bool), trial_index=pair["trial"].to_numpy())
    pts = (lambda v: v * 100 if math.isfinite(v) else None)
    ci = stats.finite_interval((d["lower"], d["upper"]))
    return {"points": pts(d["estimate"]), "ci95": [v * 100 for v in ci] if ci else None,
            "method": d["method"], "items": d["items"], "pairs": d["pairs"], "trials": d["trials"],
            "design_effect": d["design_effect"], "discordance": d["discordance"],
            "discordant": {"baseline_only": d["loss"], "config_only": d["gain"]},
            "identical_pairs": float((pair["output_b"] == pair["output_c"]).mean()) if len(pair) else None,
            # are the trials exchangeable? (per-trial differences in points; the trial that stands out)
            "trial_check": {"p": d["trial_p"], "flagged": d["trials_flagged"], "standout": d["standout_trial"],
                            "per_trial_points": [v * 100 for v in d["per_trial"]] if d["per_trial"] else None}}


def _vs_baseline(run: RunData, name: str, base: str, items: dict[str, pd.DataFrame],
                 rates: dict[str, dict[str, dict[int, float]]]) -> dict:
    cols = ["output", "answer", "correct"]
    pair = items[base][cols].merge(items[name][cols], how="inner", left_index=True,
                                   right_index=True, suffixes=("_b", "_c"))
    n = len(pair)
    cb, cc = pair["correct_b"].to_numpy(bool), pair["correct_c"].to_numpy(bool)
    base_only, cfg_only = int(np.sum(cb & ~cc)), int(np.sum(cc & ~cb))
    same = pair["output_b"] == pair["output_c"]
    diverge = [{"item_id": str(i), "position": _first_diff(r.output_b, r.output_c)}
               for i, r in pair[~same].iterrows()][:FIRST_DIVERGENCE_CAP]
    differing_answers = int((pair["answer_b"].astype(str) != pair["answer_c"].astype(str)).sum())
    # trial 0's interval, beside its McNemar test and delta (all trials: accuracy_difference)
    delta_ci = stats.finite_interval(tuple(float(v) for v in tango_interval(cfg_only, base_only, n))) if n else None
    return {
        # decode tok/s ratio (`speedup`, the schema's name) and whole-run output tok/s ratio
        "speedup": stats.paired_ratios(rates["decode"][name], rates["decode"][base]),
        "output_speedup": stats.paired_ratios(rates["output"][name], rates["output"][base]),
        "paired_items": n,
        "accuracy_delta": (cfg_only - base_only) / n * 100 if n else None,
        "accuracy_delta_ci95": [v * 100 for v in delta_ci] if delta_ci else None,
        "mcnemar_p": stats.mcnemar_exact(base_only, cfg_only) if n else None,
        "discordant": {"baseline_only": base_only, "config_only": cfg_only},
        "concordant": {"both_correct": int(np.sum(cb & cc)), "both_wrong": int(np.sum(~cb & ~cc))},
        "identical_outputs": float(same.mean()) if n else None,
        "differing_outputs": int((~same).sum()),
        "differing_answers": differing_answers,
        "first_divergence": diverge,
    }


def headline_config(summary: dict) -> str | None:
    """The config a headline compares with the baseline: 'all', else the fastest other one; an
    approximate config (a negative control, a low-precision LM head) only where no exact one ran."""
    others = [c for c in summary["configs"] if c["name"] != summary["baseline"]]
    names = [c["name"] for c in others if not c.get("approximate")] or [c["name"] for c in others]
    if not names:
        return None
    if "all" in names:
        return "all"
    speed = {c["name"]: (c["decode_tokens_per_s"]["median"] or -math.inf)
             for c in summary["configs"] if c["name"] in names}
    return max(names, key=lambda n: speed[n])


# ---------------------------------------------------------------- build

def _clean(obj: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN and infinities to null."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer, int)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if obj is pd.NA or obj is pd.NaT:
        return None
    return obj


def _trial_order(run: RunData) -> str:
    """'rotated' when trials.jsonl shows configs at different places in their trials' order (the
    measurement loop rotates it, see moebench.measuring.measure), 'fixed' when each kept its place, else
    'unknown' (no positions recorded)."""
    if run.trials is None or "position" not in run.trials:
        return "unknown"
    pos = run.trials.dropna(subset=["position"]).groupby("config")["position"].nunique()
    return "unknown" if pos.empty else ("rotated" if (pos > 1).any() else "fixed")


def build_summary(run_dir: Path, margin: float | None = None) -> dict:
    """Summary dict (schema moebench.summary/1) of a results directory; see module doc. margin:
    the non-inferiority margin of the accuracy verdicts, in points (default: the gate policy's)."""
    margin = DEFAULTS.margin if margin is None else float(margin)
    run = load_run(Path(run_dir))
    m = run.manifest
    base = m["baseline"]
    names = run.config_names
    known = set(run.samples["config"])
    items = {n: per_item(run.samples, n) for n in names}
    rates = {metric: {n: _trial_rates(run, n, metric) for n in names} for metric in METRICS}
    bandwidth = (m.get("machine") or {}).get("memory_read_gb_s")

    configs = []
    for spec in m["configs"]:
        name = spec["name"]
        steps = _config_steps(run, name)
        mine = run.samples[run.samples["config"] == name]
        decode = stats.rate_block(rates["decode"][name])
        t0 = _trial0(run, name)
        entry = {
            "name": name,
            "kernel": spec.get("kernel"),
            "scheduler": spec.get("scheduler"),
            "prefetch": spec.get("prefetch"),
            # allowed to change outputs (a negative control, an approximate profile or axis)
            "approximate": bool(spec.get("approximate", False)),
            **({"server_args": spec["args"]} if "args" in spec else {}),  # a server profile's own arguments
            # a server configuration accepted on echo evidence alone, and the profile's reason
            **({"echo_only": spec["echo_only"]} if spec.get("echo_only") else {}),
            "trials": len(rates["decode"][name]) or int(mine["trial"].nunique()),
            "decode_tokens_per_s": decode,
            "output_tokens_per_s": stats.rate_block(rates["output"][name]),
            # completed requests / the trial's wall time, `vllm bench serve`'s request throughput
            "requests_per_s": stats.rate_block(_trial_rates(run, name, "requests")),
            "accuracy": _accuracy(run.samples, items[name], name) if name in known else
            {"correct": 0, "total": 0, "value": None, "ci95": None, "trials_agree": None,
             "correct_per_trial": []},
            "latency": _latency(mine),
            "output_tokens": {k: v for k, v in stats.percentiles(
                _num(items[name], "output_tokens").dropna().to_numpy()
                if "output_tokens" in items[name] else [], (50, 95)).items()},
            "truncations": int((items[name]["finish_reason"] == "length").sum()),
            "errors": int(is_error(mine).sum()),
            "activation": _activation(run, name),
            "batching": _batching(steps),
            "expert_store": _expert_store(steps),
            "memory": _memory(run, name),
            "roofline": _roofline(steps, bandwidth, decode["median"]),
            "expert_load": t0.get("expert_load") if t0 and isinstance(t0.get("expert_load"), list) else None,
        }
        ref = spec.get("reference")  # a config with a speedup of its own against another (ablation.py)
        if ref in rates["decode"] and ref != name:
            entry["vs_reference"] = {"config": ref, "speedup": stats.paired_ratios(rates["decode"][name], rates["decode"][ref])}
        if name != base:
            vb = entry["vs_baseline"] = _vs_baseline(run, name, base, items, rates)
            vb["accuracy_difference"] = _accuracy_difference(run.samples, name, base)
            vb["accuracy_verdict"] = judge_accuracy(vb, margin, exact=not entry["approximate"])
        configs.append(entry)

    summary = {
        "schema": SCHEMA,
        "run_id": m.get("run_id", run.run_dir.name),
        "created": m.get("created"),
        "baseline": base,
        "n_items": int(run.samples["item_id"].nunique()),
        "repeats": m.get("repeats"),
        "model": m.get("model"),
        "suite": m.get("suite"),
        "runtime": m.get("runtime"),
        "machine": m.get("machine"),
        "git_commit": m.get("git_commit"),
        "configs": configs,
        "offload": _offload_tradeoff(configs, rates["decode"], base),
        # how every throughput and speedup interval above was computed (the report prints it)
        "intervals": {"method": "Student t on the logs of per-trial values (speedups: per-trial paired ratios)",
                      "trials": max((len(c["decode_tokens_per_s"]["trials"]) for c in configs), default=0),
                      "order": _trial_order(run)},
    }
    from moebench.results.serving import serving_summary

    serving = serving_summary(run)
    if serving is not None:
        summary["serving"] = serving
    summary["optimized"] = headline_config(summary)
    for entry in configs:
        if "vs_baseline" in entry:
            entry["vs_baseline"]["verdict"] = verdict(summary, entry["name"])
    summary["verdict"] = verdict(summary) if summary["optimized"] else None
    return _clean(summary)


def with_margin(summary: dict, margin: float) -> dict:
    """The summary with every accuracy verdict judged again at `margin` points (the intervals do
    not depend on it) and the verdict sentences rewritten to match."""
    import copy

    out = copy.deepcopy(summary)
    for entry in out["configs"]:
        vb = entry.get("vs_baseline")
        if vb and "accuracy_difference" in vb:
            vb["accuracy_verdict"] = judge_accuracy(vb, float(margin), exact=not entry.get("approximate"))
            vb["verdict"] = verdict(out, entry["name"])
    out["verdict"] = verdict(out) if out.get("optimized") else None
    return out


def read_summary(path: Path) -> dict:
    """A summary.json file, checked to be of this schema; MoebenchError naming it if not."""
    path = Path(path)
    summary = read_json(path)
    schema = summary.get("schema") if isinstance(summary, dict) else None
    if schema != SCHEMA:
        raise MoebenchError(f"{path}: schema {schema!r}, expected {SCHEMA!r} "
                            "(written by another moebench version: rebuild it from its results directory)")
    if not isinstance(summary.get("configs"), list) or "baseline" not in summary:
        raise MoebenchError(f"{path}: lacks 'configs' or 'baseline'")
    return summary


def load_summary(run_dir: Path) -> dict:
    """A run's summary: its summary.json, or one built from the raw files when that is absent
    or of another schema (the raw files are the source of truth). A path to a summary.json
    file is read as is."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return read_summary(run_dir)
    path = run_dir / "summary.json"
    if path.is_file():
        try:
            return read_summary(path)
        except MoebenchError:
            if not (run_dir / "manifest.json").is_file():
                raise
    return build_summary(run_dir)


