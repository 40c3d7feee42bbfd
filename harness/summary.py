"""summary.json: every number the report and the gate need, computed once from a results dir.

build_summary(run_dir) reads manifest.json, samples.jsonl, trials.jsonl and steps.parquet
(format: docs/results-format.md). trials.jsonl and steps.parquet are optional: what they
feed becomes null. verdict(summary) turns one config's comparison into a plain sentence.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moebench import stats
from moebench.errors import MoebenchError
from moebench.fileio import read_jsonl

SCHEMA = "moebench.summary/1"
MANIFEST_SCHEMA = "moebench.manifest/1"
FIRST_DIVERGENCE_CAP = 50
# Step-level bootstraps resample thousands of rows; fewer replicates keep them quick and
# are plenty for a 95% percentile interval.
STEP_BOOT = 2_000
# Below this many trials a bootstrap over trials is meaningless (3 values have 10 distinct
# resamples), so throughput intervals come from step-level resampling instead.
MIN_TRIALS_FOR_TRIAL_CI = 3


@dataclass
class RunData:
    run_dir: Path
    manifest: dict
    samples: pd.DataFrame
    trials: pd.DataFrame | None
    steps: pd.DataFrame | None

    @property
    def config_names(self) -> list[str]:
        return [c["name"] for c in self.manifest["configs"]]


# ---------------------------------------------------------------- loading

def _load_manifest(path: Path) -> dict:
    if not path.is_file():
        raise MoebenchError(f"{path}: missing (not a moebench results directory?)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise MoebenchError(f"{path}: expected a JSON object")
    schema = manifest.get("schema", MANIFEST_SCHEMA)
    if schema != MANIFEST_SCHEMA:
        raise MoebenchError(f"{path}: schema {schema!r}, expected {MANIFEST_SCHEMA!r}")
    configs = manifest.get("configs")
    if not isinstance(configs, list) or not configs or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in configs):
        raise MoebenchError(f"{path}: 'configs' must be a non-empty list of objects with a 'name'")
    names = [c["name"] for c in configs]
    if len(set(names)) != len(names):
        raise MoebenchError(f"{path}: duplicate config names in 'configs'")
    baseline = manifest.get("baseline", names[0])
    if baseline not in names:
        raise MoebenchError(f"{path}: baseline {baseline!r} is not one of the configs {names}")
    manifest["baseline"] = baseline
    return manifest


def _load_jsonl_table(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    records = read_jsonl(path)
    for lineno, rec in enumerate(records, 1):
        if not isinstance(rec, dict) or any(k not in rec for k in required):
            missing = [k for k in required if not isinstance(rec, dict) or k not in rec]
            raise MoebenchError(f"{path}: record {lineno} lacks {', '.join(missing)}")
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return pd.DataFrame(columns=list(required))
    df["trial"] = pd.to_numeric(df["trial"], errors="coerce")
    if df["trial"].isna().any():
        raise MoebenchError(f"{path}: 'trial' must be an integer in every record")
    df["trial"] = df["trial"].astype(int)
    df["config"] = df["config"].astype(str)
    return df


def _load_samples(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise MoebenchError(f"{path}: missing (no samples: nothing to summarize)")
    df = _load_jsonl_table(path, ("config", "trial", "item_id"))
    if df.empty:
        raise MoebenchError(f"{path}: no samples")
    df["item_id"] = df["item_id"].astype(str)
    for col, default in (("output", ""), ("answer", None), ("correct", False),
                         ("finish_reason", None), ("error", None), ("itl_s", None)):
        if col not in df:
            df[col] = default
    df["output"] = df["output"].fillna("").astype(str)
    df["correct"] = df["correct"].map(lambda v: v is True or v == 1)
    # A resumed run may re-append an item; the last complete line wins.
    return df.drop_duplicates(subset=["config", "trial", "item_id"], keep="last").reset_index(drop=True)


def _load_trials(path: Path) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    df = _load_jsonl_table(path, ("config", "trial"))
    if df.empty:
        return None
    return df.drop_duplicates(subset=["config", "trial"], keep="last").sort_values(
        ["config", "trial"]).reset_index(drop=True)


def _load_steps(path: Path) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise MoebenchError(f"{path}: unreadable parquet ({type(e).__name__}: {e})") from None
    for col in ("config", "trial"):
        if col not in df:
            raise MoebenchError(f"{path}: missing column {col!r}")
    if df.empty:
        return None
    df["config"] = df["config"].astype(str)
    return df


def load_run(run_dir: Path) -> RunData:
    """Read a results directory; MoebenchError naming the file if something is unusable."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MoebenchError(f"{run_dir}: not a directory")
    return RunData(
        run_dir=run_dir,
        manifest=_load_manifest(run_dir / "manifest.json"),
        samples=_load_samples(run_dir / "samples.jsonl"),
        trials=_load_trials(run_dir / "trials.jsonl"),
        steps=_load_steps(run_dir / "steps.parquet"),
    )


# ---------------------------------------------------------------- small helpers

def _ci(interval: tuple[float, float]) -> list[float] | None:
    lo, hi = interval
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return [float(lo), float(hi)]


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


def per_item(samples: pd.DataFrame, name: str) -> pd.DataFrame:
    """One sample per item for a config: trial 0's (the lowest trial that has the item).

    Greedy decoding makes every trial give the same answer, so trial 0 stands for all.
    """
    df = samples[samples["config"] == name].sort_values("trial", kind="stable")
    return df.drop_duplicates(subset=["item_id"], keep="first").set_index("item_id")


# ---------------------------------------------------------------- throughput

def _trial_rates(run: RunData, name: str) -> dict[int, float]:
    """Decode tok/s per trial: decode_tokens / decode_s (trials.jsonl, else summed steps)."""
    rates: dict[int, float] = {}
    if run.trials is not None and {"decode_tokens", "decode_s"} <= set(run.trials.columns):
        t = run.trials[run.trials["config"] == name]
        for trial, tok, sec in zip(t["trial"], _num(t, "decode_tokens"), _num(t, "decode_s")):
            if pd.notna(tok) and pd.notna(sec) and sec > 0:
                rates[int(trial)] = float(tok) / float(sec)
        if rates:
            return rates
    dec = _decode_steps(_config_steps(run, name))
    if dec is not None:
        for trial, g in dec.groupby("trial"):
            sec = float(_num(g, "duration_s").sum())
            if sec > 0:
                rates[int(trial)] = float(_num(g, "decode_tokens").sum()) / sec
    return rates


def _step_replicates(run: RunData, name: str, seed: int) -> tuple[np.ndarray, float] | None:
    """Bootstrap replicates of the step-level decode rate and its point value."""
    dec = _decode_steps(_config_steps(run, name))
    if dec is None or len(dec) < 2:
        return None
    tok = _num(dec, "decode_tokens").to_numpy(float)
    dur = _num(dec, "duration_s").to_numpy(float)
    ok = np.isfinite(tok) & np.isfinite(dur)
    tok, dur = tok[ok], dur[ok]
    if tok.size < 2 or dur.sum() <= 0:
        return None
    reps = stats.bootstrap_rate_replicates(tok, dur, n_boot=STEP_BOOT, seed=seed)
    return reps, float(tok.sum() / dur.sum())


def _scaled_ci(point: float, rel: np.ndarray) -> list[float] | None:
    """Interval of point x (relative replicates): the steps give the noise, trials the level.

    Step-level rates and trials.jsonl's decode_s can measure slightly different wall time,
    so only the spread of the step bootstrap is used, centred on the trial-level value.
    """
    rel = rel[np.isfinite(rel)]
    if rel.size == 0 or not math.isfinite(point):
        return None
    lo, hi = np.quantile(rel, [0.025, 0.975])
    return [float(point * lo), float(point * hi)]


def _decode_block(run: RunData, name: str, rates: dict[int, float], seed: int) -> dict:
    values = [rates[t] for t in sorted(rates)]
    block: dict[str, Any] = {"median": float(np.median(values)) if values else None,
                             "ci95": None, "trials": values, "ci_method": None}
    if not values:
        return block
    if len(values) >= MIN_TRIALS_FOR_TRIAL_CI:
        block["ci95"] = _ci(stats.bootstrap_median_ci(values, seed=seed))
        block["ci_method"] = "bootstrap over trials"
    else:
        reps = _step_replicates(run, name, seed)
        if reps is not None:
            block["ci95"] = _scaled_ci(block["median"], reps[0] / reps[1])
            block["ci_method"] = "bootstrap over decode steps"
    return block


def _output_rate_block(run: RunData, name: str, seed: int) -> dict:
    values: list[float] = []
    if run.trials is not None and {"output_tokens", "wall_s"} <= set(run.trials.columns):
        t = run.trials[run.trials["config"] == name]
        for tok, sec in zip(_num(t, "output_tokens"), _num(t, "wall_s")):
            if pd.notna(tok) and pd.notna(sec) and sec > 0:
                values.append(float(tok) / float(sec))
    ci = _ci(stats.bootstrap_median_ci(values, seed=seed)) if len(values) >= MIN_TRIALS_FOR_TRIAL_CI else None
    return {"median": float(np.median(values)) if values else None, "ci95": ci, "trials": values}


def _speedup(run: RunData, name: str, base: str, rates: dict[str, dict[int, float]],
             seed: int) -> dict:
    rc, rb = rates[name], rates[base]
    if not rc or not rb:
        return {"median": None, "ci95": None, "ci_method": None}
    median = float(np.median(list(rc.values())) / np.median(list(rb.values())))
    common = sorted(set(rc) & set(rb))
    if len(common) >= MIN_TRIALS_FOR_TRIAL_CI:
        ci = _ci(stats.bootstrap_ratio_of_medians_ci([rc[t] for t in common], [rb[t] for t in common],
                                                     paired=True, seed=seed))
        return {"median": median, "ci95": ci, "ci_method": "paired bootstrap over trials"}
    sc, sb = _step_replicates(run, name, seed), _step_replicates(run, base, seed + 1)
    if sc is not None and sb is not None:
        rel = (sc[0] / sc[1]) / (sb[0] / sb[1])
        return {"median": median, "ci95": _scaled_ci(median, rel),
                "ci_method": "bootstrap over decode steps"}
    return {"median": median, "ci95": None, "ci_method": None}


# ---------------------------------------------------------------- samples

def _accuracy(samples: pd.DataFrame, items: pd.DataFrame, name: str) -> dict:
    correct, total = int(items["correct"].sum()), int(len(items))
    mine = samples[samples["config"] == name]
    per_trial = {int(t): int(g["correct"].sum()) for t, g in mine.groupby("trial")}
    # Trials agree when every item has one output text across all trials that ran it.
    agree = bool((mine.groupby("item_id")["output"].nunique() <= 1).all())
    return {"correct": correct, "total": total,
            "value": correct / total if total else None,
            "ci95": _ci(stats.wilson_ci(correct, total)),
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


def _is_error(df: pd.DataFrame) -> pd.Series:
    err = df["error"].notna()
    if "finish_reason" in df:
        err |= df["finish_reason"] == "error"
    return err


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
    if run.trials is None:
        return {"ok": None, "evidence": None, "errors": []}
    t = run.trials[run.trials["config"] == name]
    if t.empty:
        return {"ok": None, "evidence": None, "errors": []}
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
    evidence = t.iloc[0].get("evidence")
    return {"ok": ok, "evidence": evidence if isinstance(evidence, dict) else None, "errors": errors}


# ---------------------------------------------------------------- comparison

def _first_diff(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _vs_baseline(run: RunData, name: str, base: str, items: dict[str, pd.DataFrame],
                 rates: dict[str, dict[int, float]], seed: int) -> dict:
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
    delta_ci = _ci(stats.paired_accuracy_diff_ci(cb, cc, seed=seed))
    return {
        "speedup": _speedup(run, name, base, rates, seed),
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
    """The config a headline compares with the baseline: 'all', else the fastest other one."""
    names = [c["name"] for c in summary["configs"] if c["name"] != summary["baseline"]]
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


def build_summary(run_dir: Path, seed: int = stats.DEFAULT_SEED) -> dict:
    """Summary dict (schema moebench.summary/1) of a results directory; see module doc."""
    run = load_run(Path(run_dir))
    m = run.manifest
    base = m["baseline"]
    names = run.config_names
    known = set(run.samples["config"])
    items = {n: per_item(run.samples, n) for n in names}
    rates = {n: _trial_rates(run, n) for n in names}
    bandwidth = (m.get("machine") or {}).get("memory_read_gb_s")

    configs = []
    for spec in m["configs"]:
        name = spec["name"]
        steps = _config_steps(run, name)
        mine = run.samples[run.samples["config"] == name]
        decode = _decode_block(run, name, rates[name], seed)
        t0 = _trial0(run, name)
        entry = {
            "name": name,
            "kernel": spec.get("kernel"),
            "scheduler": spec.get("scheduler"),
            "prefetch": spec.get("prefetch"),
            "trials": len(rates[name]) or int(mine["trial"].nunique()),
            "decode_tokens_per_s": decode,
            "output_tokens_per_s": _output_rate_block(run, name, seed),
            "accuracy": _accuracy(run.samples, items[name], name) if name in known else
            {"correct": 0, "total": 0, "value": None, "ci95": None, "trials_agree": None,
             "correct_per_trial": []},
            "latency": _latency(mine),
            "output_tokens": {k: v for k, v in stats.percentiles(
                _num(items[name], "output_tokens").dropna().to_numpy()
                if "output_tokens" in items[name] else [], (50, 95)).items()},
            "truncations": int((items[name]["finish_reason"] == "length").sum()),
            "errors": int(_is_error(mine).sum()),
            "activation": _activation(run, name),
            "batching": _batching(steps),
            "expert_store": _expert_store(steps),
            "roofline": _roofline(steps, bandwidth, decode["median"]),
            "expert_load": t0.get("expert_load") if t0 and isinstance(t0.get("expert_load"), list) else None,
        }
        if name != base:
            entry["vs_baseline"] = _vs_baseline(run, name, base, items, rates, seed)
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
    }
    summary["optimized"] = headline_config(summary)
    for entry in configs:
        if "vs_baseline" in entry:
            entry["vs_baseline"]["verdict"] = verdict(summary, entry["name"])
    summary["verdict"] = verdict(summary) if summary["optimized"] else None
    return _clean(summary)


def read_summary(path: Path) -> dict:
    """A summary.json file, checked to be of this schema; MoebenchError naming it if not."""
    path = Path(path)
    if not path.is_file():
        raise MoebenchError(f"{path}: missing")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: not valid JSON ({e})") from None
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


# ---------------------------------------------------------------- verdict

def config_entry(summary: dict, name: str) -> dict:
    for c in summary["configs"]:
        if c["name"] == name:
            return c
    raise MoebenchError(f"summary of run {summary.get('run_id')}: no config named {name!r}")


def format_p(p: float | None) -> str:
    if p is None:
        return "n/a"
    if p >= 0.9995:
        return "1.0"
    if p < 1e-4:
        return "< 0.0001"
    return f"{p:.3g}"


def _speed_phrase(sp: dict) -> str:
    med, ci = sp.get("median"), sp.get("ci95")
    if med is None:
        return "speedup unknown (no timing data)"
    if ci is None:
        return f"speedup {med:.2f}x (no confidence interval: too few trials and no step data)"
    span = f"95% CI {ci[0]:.2f}-{ci[1]:.2f}"
    if ci[0] > 1:
        return f"speedup {med:.2f}x ({span})"
    if ci[1] < 1:
        return f"slowdown: {med:.2f}x the baseline's speed ({span})"
    return f"no speed change detected: {med:.2f}x ({span})"


def _accuracy_phrase(cfg: dict, base: dict, vb: dict) -> str:
    p, n = vb.get("mcnemar_p"), vb.get("paired_items") or 0
    d = vb.get("discordant") or {}
    if p is None or n == 0:
        return "accuracy not comparable (no items in common with the baseline)"
    pairs = f"{d.get('baseline_only', 0)} vs {d.get('config_only', 0)} discordant pairs"
    if p >= 0.05:
        return (f"no accuracy change detected: {vb.get('differing_answers', 0)} of {n} answers differ, "
                f"{pairs} (McNemar p = {format_p(p)})")
    ab, ac = base["accuracy"]["value"] or 0.0, cfg["accuracy"]["value"] or 0.0
    return (f"accuracy changed: {ab:.2%} -> {ac:.2%} ({vb['accuracy_delta']:+.2f} points; "
            f"{pairs}; McNemar p = {format_p(p)})")


def verdict(summary: dict, name: str | None = None) -> str:
    """One sentence on a config vs the baseline, e.g. 'speedup 1.90x (95% CI 1.80-2.00); ...'."""
    name = name or summary.get("optimized")
    if name is None:
        return "no configuration to compare with the baseline"
    cfg = config_entry(summary, name)
    vb = cfg.get("vs_baseline")
    if not vb:
        return f"{name} is the baseline"
    text = f"{_speed_phrase(vb['speedup'])}; {_accuracy_phrase(cfg, config_entry(summary, summary['baseline']), vb)}"
    if cfg["activation"].get("ok") is False:
        text = f"NOT VALID, an optimization did not activate ({name}); " + text
    return text
