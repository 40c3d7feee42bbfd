"""The summary's `serving` block: per configuration and offered load, achieved throughput, latency
percentiles, goodput under the run's SLOs, the measuring client's send lag, and for a fluctuating
load the stability of throughput over its windows (docs/serving-load.md).

Throughput and goodput are per trial (completed requests, or those that met every SLO, over the
trial's wall time) with intervals over trials; latency percentiles pool the trials' requests; the
comparison with the baseline at each load pairs trials (the per-trial ratio of P99 TTFT, of goodput).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from moebench.results import stats
from moebench.results.run_data import RunData, is_error

LATENCY_COLUMNS = ("ttft_s", "tpot_s", "latency_s")
QUANTILES = (50, 90, 99)


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[~is_error(df)]


def met_slos(df: pd.DataFrame, slo: dict[str, float]) -> pd.Series:
    """Which requests met every SLO: a failed request meets none; a one-token request has no TPOT to miss."""
    met = ~is_error(df)
    for column, limit in slo.items():
        values = pd.to_numeric(df[column], errors="coerce") if column in df else pd.Series(np.nan, index=df.index)
        within = values <= limit
        if column == "tpot_s":
            within |= values.isna()
        met &= within
    return met


def _mean_interval(values: list[float]) -> dict:
    """Mean with a Student t interval over trials (goodput can be 0, so not on logs), cut at 0: a rate
    below 0 is impossible, so cutting there loses no coverage."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if x.size == 0:
        return {"mean": None, "ci95": None, "trials": []}
    if x.size < 2:
        return {"mean": float(x.mean()), "ci95": None, "trials": x.tolist()}
    from scipy.stats import t as student_t

    half = student_t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return {"mean": float(x.mean()), "ci95": [max(float(x.mean() - half), 0.0), float(x.mean() + half)],
            "trials": x.tolist()}


def _token_times(row) -> np.ndarray:
    """A request's token times, seconds from the trial's start (sent + TTFT + its inter-token gaps)."""
    if row.get("sent_s") is None or row.get("ttft_s") is None or (isinstance(row["ttft_s"], float) and math.isnan(row["ttft_s"])):
        return np.empty(0)
    itl = row.get("itl_s")
    gaps = np.asarray(list(itl) if isinstance(itl, (list, tuple, np.ndarray)) else [], dtype=float)
    return float(row["sent_s"]) + float(row["ttft_s"]) + np.concatenate([[0.0], np.cumsum(gaps)])


def window_throughput(samples: pd.DataFrame, window_s: float, until_s: float) -> np.ndarray:
    """Output tokens/s in consecutive windows of one trial, up to the last arrival (the drain after it
    is not offered load). Each streamed chunk carries its share of the request's output tokens."""
    n = max(int(until_s // window_s), 1)
    counts = np.zeros(n)
    for row in _ok(samples).to_dict("records"):
        times = _token_times(row)
        if times.size == 0:
            continue
        weight = (row.get("output_tokens") or times.size) / times.size
        idx = (times // window_s).astype(int)
        np.add.at(counts, idx[idx < n], weight)
    return counts / window_s


def _stability(samples: pd.DataFrame, load: dict) -> dict | None:
    """Throughput per window of a fluctuating load's period, per trial: its coefficient of variation
    and extremes; none where the arrivals cover fewer than two whole windows."""
    fl = load.get("fluctuate")
    if not fl or not load.get("arrivals_s"):
        return None
    window = float(fl["period_s"])
    whole = int(float(load["arrivals_s"][-1]) // window)
    if whole < 2:
        return {"window_s": window, "windows": whole, "median_cv": None, "worst_min_over_mean": None,
                "worst_max_over_mean": None, "trials": [],
                "note": f"the arrivals span {whole} whole window(s) of {window:g} s: too few to judge; "
                        "give more requests (--limit) or a shorter period"}
    per_trial = []
    for _, trial in samples.groupby("trial"):
        tput = window_throughput(trial, window, float(load["arrivals_s"][-1]))
        mean = tput.mean()
        per_trial.append({"windows": tput.round(3).tolist(),
                          "cv": float(tput.std(ddof=0) / mean) if mean > 0 else None,
                          "min_over_mean": float(tput.min() / mean) if mean > 0 else None,
                          "max_over_mean": float(tput.max() / mean) if mean > 0 else None})
    cvs = [t["cv"] for t in per_trial if t["cv"] is not None]
    return {"window_s": window, "windows": whole, "median_cv": float(np.median(cvs)) if cvs else None,
            "worst_min_over_mean": min((t["min_over_mean"] for t in per_trial if t["min_over_mean"] is not None), default=None),
            "worst_max_over_mean": max((t["max_over_mean"] for t in per_trial if t["max_over_mean"] is not None), default=None),
            "trials": per_trial}


def _point(samples: pd.DataFrame, trials: pd.DataFrame | None, load: dict, slo: dict) -> dict:
    ok = _ok(samples)
    walls = {} if trials is None else dict(zip(trials["trial"], trials["wall_s"]))
    per_trial = {}
    for t, g in samples.groupby("trial"):
        wall = walls.get(t)
        if not wall:
            continue
        good = _ok(g)
        per_trial[int(t)] = {"achieved_rps": len(good) / wall,
                             "output_tok_s": float(pd.to_numeric(good["output_tokens"]).sum()) / wall,
                             "goodput_rps": float(met_slos(g, slo).sum()) / wall if slo else None,
                             "p99_ttft_s": float(np.percentile(pd.to_numeric(good["ttft_s"]).dropna(), 99))
                             if len(good) else None}
    point = {
        "offered_rps": load.get("rate"),
        "trials": len(per_trial),
        "requests": int(len(samples)), "errors": int(len(samples) - len(ok)),
        "achieved_rps": stats.rate_block({t: v["achieved_rps"] for t, v in per_trial.items()}),
        "output_tok_s": stats.rate_block({t: v["output_tok_s"] for t, v in per_trial.items()}),
        **{col: stats.percentiles(pd.to_numeric(ok[col], errors="coerce").dropna().to_numpy()
                                  if col in ok else [], QUANTILES) for col in LATENCY_COLUMNS},
        "per_trial": per_trial,
    }
    if slo:
        met = met_slos(samples, slo)
        point["goodput_rps"] = _mean_interval([v["goodput_rps"] for v in per_trial.values()])
        point["slo_attainment"] = float(met.mean()) if len(met) else None
    if "scheduled_s" in samples and samples["scheduled_s"].notna().any():
        lag = (pd.to_numeric(samples["sent_s"]) - pd.to_numeric(samples["scheduled_s"])).dropna().to_numpy()
        point["send_lag_s"] = {**stats.percentiles(lag, QUANTILES), "max": float(lag.max()) if lag.size else None}
    stability = _stability(samples, load)
    if stability is not None:
        point["stability"] = stability
    return point


def _paired_ratio(mine: dict, base: dict, key: str) -> dict:
    """stats.paired_ratios of one per-trial figure: a trial counts where the config has the figure and
    the baseline's is above 0 (a config's 0 goodput stays in: a ratio of 0)."""
    return stats.paired_ratios({t: v[key] for t, v in mine.items() if v.get(key) is not None},
                               {t: v[key] for t, v in base.items() if v.get(key)})


def serving_summary(run: RunData) -> dict | None:
    """The `serving` block, or None for a closed-loop run without loads."""
    by = run.by_load
    if by is None:
        return None
    slo = run.manifest.get("slo") or {}
    loads = {ld["label"]: ld for ld in run.manifest["loads"]}
    base = run.manifest["baseline"]
    configs: dict[str, dict] = {}
    for name in run.config_names:
        mine = by.samples[by.samples["config"] == name]
        mine_trials = by.trials[by.trials["config"] == name] if by.trials is not None else None
        points = {}
        for label in by.labels:
            at = mine[mine["load"] == label]
            if at.empty:
                continue
            points[label] = _point(at, mine_trials[mine_trials["load"] == label] if mine_trials is not None else None,
                                   loads[label], slo)
        configs[name] = points
    for name, points in configs.items():
        if name == base:
            continue
        for label, point in points.items():
            b = configs.get(base, {}).get(label)
            if b is None:
                continue
            vs = {"p99_ttft_ratio": _paired_ratio(point["per_trial"], b["per_trial"], "p99_ttft_s"),
                  "achieved_ratio": _paired_ratio(point["per_trial"], b["per_trial"], "achieved_rps")}
            if slo:
                vs["goodput_ratio"] = _paired_ratio(point["per_trial"], b["per_trial"], "goodput_rps")
            point["vs_baseline"] = vs
    return {"loads": [{k: v for k, v in loads[label].items() if k != "arrivals_s"} for label in by.labels],
            "primary": by.primary,
            "slo": slo, "configs": configs}
