"""The verdict in words: one sentence per config against the baseline (speed, then accuracy), and
the accuracy verdict with its power: identical, non-inferior, regression or inconclusive.

The accuracy verdict judges the paired difference config - baseline over every (item, trial)
pair, clustered by item (moebench.results.paired_accuracy; summary.json's `accuracy_difference`), against
a margin in points (docs/statistics.md):

  identical      an exact config (not marked approximate) whose every paired output equals the
                 baseline's: accuracy cannot have changed on these items, whatever the interval;
  regression     the interval lies entirely below 0, or trial 0's exact McNemar test finds a
                 change (p < alpha) against the config;
  non-inferior   the interval's lower end lies above -margin;
  inconclusive   otherwise: too few items to tell a drop of the margin from none.

Every verdict states the smallest drop the run would have detected with 80% power. Light: no
pandas or scipy at import (the report's and gate's --help import this module's callers).
"""

from __future__ import annotations

from moebench.errors import MoebenchError


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


def _speed_phrase(sp: dict, what: str = "") -> str:
    med, ci = sp.get("median"), sp.get("ci95")
    what = f" {what}" if what else ""
    if med is None:
        return f"speedup unknown{what} (no timing data)"
    if ci is None:
        return f"speedup {med:.2f}x{what} (no confidence interval: one trial)"
    span = f"95% CI {ci[0]:.2f}-{ci[1]:.2f}, {len(sp.get('trials') or [])} trials"
    if ci[0] > 1:
        return f"speedup {med:.2f}x{what} ({span})"
    if ci[1] < 1:
        return f"slowdown{what}: {med:.2f}x the baseline's speed ({span})"
    return f"no speed change detected{what}: {med:.2f}x ({span})"


def _accuracy_phrase_mcnemar(cfg: dict, base: dict, vb: dict) -> str:
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
    text = f"{_speed_phrase(vb['speedup'], 'in decode tok/s')}"
    if vb.get("output_speedup") and vb["output_speedup"].get("median") is not None:
        text += f"; {_speed_phrase(vb['output_speedup'], 'in output tok/s over the whole run')}"
    text += f"; {_accuracy_phrase_mcnemar(cfg, config_entry(summary, summary['baseline']), vb)}"
    statement = (vb.get("accuracy_verdict") or {}).get("statement")
    if statement and vb.get("paired_items"):
        text += f"; accuracy verdict: {statement}"
    if cfg["activation"].get("ok") is False:
        text = f"NOT VALID, an optimization did not activate ({name}); " + text
    return text


# ---------------------------------------------------------------- the accuracy verdict

def _pts(v: float) -> str:
    return f"{0.0 + v:+.2f}"  # 0.0 + v: no "-0.00"


def judge_accuracy(vb: dict, margin: float, exact: bool, alpha: float = 0.05) -> dict:
    """The accuracy verdict of one config from its `vs_baseline` block: {verdict, margin,
    detectable_drop (points), statement}; verdict None when nothing could be paired."""
    diff = vb.get("accuracy_difference") or {}
    ci, drop = diff.get("ci95"), diff.get("detectable_drop")
    out = {"verdict": None, "margin": margin, "detectable_drop": drop, "statement": None}
    if not diff.get("pairs") or not ci:
        out["statement"] = "accuracy not comparable (no items in common with the baseline)"
        return out
    est = diff["points"]
    shape = f"{diff['items']} items" + (f" x {diff['trials']} trials" if diff.get("trials", 1) > 1 else "")
    interval = f"{_pts(est)} points (95% CI {_pts(ci[0])} to {_pts(ci[1])}, {shape})"
    power = ("" if drop is None else
             f"a drop of {drop:.1f} points or more would have been detected with 80% power")
    d = vb.get("discordant") or {}
    p = vb.get("mcnemar_p")
    against = p is not None and p < alpha and d.get("baseline_only", 0) > d.get("config_only", 0)
    if exact and diff.get("identical_pairs") == 1:
        out["verdict"] = "identical"
        text = (f"identical: all {diff['pairs']} paired outputs equal the baseline's (an exact "
                f"optimization), so accuracy did not change on these items; difference {interval}")
    elif ci[1] < 0 or against:
        out["verdict"] = "regression"
        why = "the interval lies below 0" if ci[1] < 0 else f"McNemar p = {format_p(p)} on trial 0"
        text = f"regression: accuracy fell, {interval}; {why}"
        power = ""
    elif ci[0] > -margin:
        out["verdict"] = "non-inferior"
        text = f"non-inferior at a {margin:g}-point margin: difference {interval}"
    else:
        out["verdict"] = "inconclusive"
        text = (f"inconclusive: too few items: difference {interval} reaches below the "
                f"-{margin:g}-point margin")
    if power:
        text += f"; {power}; none was"
    out["statement"] = text
    return out
