"""The verdict in words: one sentence per config against the baseline (speed, then accuracy), and
the accuracy verdict: one decision table, monotone in harm, with one knob, the margin (points).

The accuracy verdict judges the paired difference config - baseline over every (item, trial)
pair, clustered by item, with its trial component (moebench.results.paired_accuracy;
summary.json's `accuracy_difference`):

  identical      an exact config (not marked approximate) whose every paired output equals the
                 baseline's: no item changed; the sentence says how many items like these could
                 change unseen (one-sided 95%).                                               pass
  non-inferior   the interval's lower end lies above -margin, and the trials agree with each
                 other. An interval also below 0 is a drop shown within the margin: a warning.  pass
  regression     the interval lies below 0 and non-inferiority is not shown.                 fail
  inconclusive   neither: the run is too small (or its trials disagree) to tell a drop of the
                 margin from none.                             fail by default (on_inconclusive)

More evidence narrows the interval: a harmless drop (inside the margin) can only move from
inconclusive to non-inferior, a harmful one only from inconclusive to regression. Trial 0's
McNemar test is reported as the seed's own statistic; it decides nothing. Light: no pandas or
scipy at import (the report's and gate's --help import this module's callers).
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

VERDICTS = ("identical", "non-inferior", "regression", "inconclusive")
PASSING = ("identical", "non-inferior")
POWER_EVENT = "called a regression in >= 80% of runs like this one"
ANSWER_MODELS = ("the worst of same-seed and diverged answers, a drop in whole items or spread "
                 "over trials")


def decide(lower, upper, margin_fraction, trials_flagged=False):
    """The decision table on (arrays of) interval ends, as fractions: an array of verdict codes,
    indices into VERDICTS (identical is decided from the outputs, before this)."""
    import numpy as np

    lo, hi, flagged = np.broadcast_arrays(np.asarray(lower, float), np.asarray(upper, float),
                                          np.asarray(trials_flagged, bool))
    non_inferior = (lo > -margin_fraction) & ~flagged
    return np.where(non_inferior, 1, np.where(hi < 0, 2, 3))


def _pts(v: float) -> str:
    return f"{0.0 + v:+.2f}"  # 0.0 + v: no "-0.00"


def _detectable(diff: dict, margin: float) -> float | None:
    """The detectable drop at this margin, in points (moebench.results.paired_accuracy)."""
    from moebench.results.paired_accuracy import detectable_drop

    if not diff.get("pairs") or diff.get("discordance") is None:
        return diff.get("detectable_drop")  # a summary written before the inputs were kept
    d = float(detectable_drop(diff["pairs"], diff["items"], diff["discordance"],
                              diff.get("design_effect") or 1.0, margin / 100))
    return None if d != d else d * 100


def judge_accuracy(vb: dict, margin: float, exact: bool) -> dict:
    """The accuracy verdict of one config from its `vs_baseline` block: {verdict, margin,
    detectable_drop (points), statement, warning}; verdict None when nothing could be paired."""
    from moebench.results.paired_accuracy import identical_bound

    diff = vb.get("accuracy_difference") or {}
    ci = diff.get("ci95")
    out = {"verdict": None, "margin": margin, "detectable_drop": None, "statement": None, "warning": None}
    if not diff.get("pairs") or not ci:
        out["statement"] = "accuracy not comparable (no items in common with the baseline)"
        return out
    drop = out["detectable_drop"] = _detectable(diff, margin)
    est, items = diff["points"], diff["items"]
    shape = f"{items} items" + (f" x {diff['trials']} trials" if diff.get("trials", 1) > 1 else "")
    interval = f"{_pts(est)} points (95% CI {_pts(ci[0])} to {_pts(ci[1])}, {shape})"
    trials = diff.get("trial_check") or {}
    flagged = bool(trials.get("flagged"))
    power = ("no drop is detectable at 80% power with so few items" if drop is None else
             f"a true drop of {drop:.1f} points or more would have been {POWER_EVENT} ({ANSWER_MODELS})")
    if exact and diff.get("identical_pairs") == 1:
        out["verdict"] = "identical"
        bound = identical_bound(items)
        out["statement"] = (f"identical: 0 of {items} items changed in any of {diff['pairs']} paired outputs "
                            f"(an exact optimization): at most {bound:.1%} of items like these would change "
                            f"(one-sided 95%, about 3/{items})")
        return out
    out["verdict"] = VERDICTS[int(decide(ci[0] / 100, ci[1] / 100, margin / 100, flagged))]
    trial_words = ""
    if flagged:
        trial_words = (f"; the trials disagree more than sampling items explains (p = {format_p(trials.get('p'))}; "
                       f"trial {trials.get('standout')} stands out), so non-inferiority cannot be shown")
    if out["verdict"] == "non-inferior":
        text = f"non-inferior at a {margin:g}-point margin: difference {interval}"
        if ci[1] < 0:
            out["warning"] = (f"a drop of {-est:.2f} points is shown (the interval lies below 0), "
                              f"within the {margin:g}-point margin")
            text += f"; {out['warning']}"
    elif out["verdict"] == "regression":
        why = (f"the interval lies below 0{trial_words}" if flagged else
               f"the interval lies below 0 and does not exclude a drop of the {margin:g}-point margin")
        text = f"regression: accuracy fell, {interval}; {why}"
        power = ""
    else:
        where = (f"reaches below the -{margin:g}-point margin and above 0" if ci[0] <= -margin else
                 f"lies above the -{margin:g}-point margin")
        text = f"inconclusive: difference {interval} {where}{trial_words}"
    out["statement"] = text + (f"; {power}" if power else "")
    return out
