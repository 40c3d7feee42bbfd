"""The accuracy verdict under simulation: coverage of its interval, how often it says each verdict,
the power its printed detectable drop promises, and `moebench plan`'s items, in answer models
built to break it (docs/statistics.md has the figures).

A simulated run answers `items` items in `trials` trials. Item i's baseline is right with
probability p_i ~ Beta(acc k, (1 - acc) k), k = 1.5: U-shaped, most items nearly always right or
nearly always wrong, as a good model's are. How the config's answers relate to the baseline's:

  same-spread      shared seeds: the config repeats the baseline's answer except on fragile items
                   (a fifth), where it loses or gains answers at equal expected rates (noise that
                   changes outputs but not accuracy); the drop takes each right answer with the
                   same probability, trial by trial;
  same-items       the same noise; the drop breaks whole items (wrong in every trial);
  diverged-spread  the config's answers are independent draws at p_i (1 - drop / acc): outputs
                   differ everywhere sampling lets them (an FP8 head, other kernels' rounding);
  diverged-items   independent draws at p_i, and the drop breaks whole items;
  greedy           as same-items, but every trial repeats trial 0 (temperature 0);
  shock            diverged-spread, and one trial of each run (at random) is shocked: in it the
                   config loses a fifth of its right answers on a random 5% of items;
  shock-strong     the same with half the right answers on 30% of items.

The truth is the population difference (expected over items and trials); a shock is a fault of
one trial, not part of the config's difference, so a run that does not flag it misleads. The verdict is
moebench's (moebench.results.verdict.decide on moebench.results.paired_accuracy's interval, trial
check and detectable drop), computed by the same functions the summary uses, on arrays of runs.

    python benchmarks/paired_accuracy_coverage.py [--runs 1000] [--seed 0] [--out FILE.json]
    python benchmarks/paired_accuracy_coverage.py --power   # regression rate at the printed drop
    python benchmarks/paired_accuracy_coverage.py --plan    # plan's items against simulation
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from moebench.results.paired_accuracy import (design_effect, detectable_drop, items_for_margin, tango_interval,
                                              trial_check, with_item_floor, with_trial_component)
from moebench.results.verdict import VERDICTS, decide

ITEMS = (48, 200, 1319)
TRIALS = (1, 3, 5)
ACCURACY = (0.6, 0.9, 0.99)
DROPS = (0.0, 0.005, 0.01, 0.02, 0.03)
MODELS = ("same-spread", "same-items", "diverged-spread", "diverged-items", "greedy", "shock", "shock-strong")
MULTI_TRIAL_ONLY = ("greedy", "shock", "shock-strong")
MARGIN = 0.01
HETEROGENEITY = 1.5
FRAGILE = 0.2
SHOCKS = {"shock": (0.05, 0.2), "shock-strong": (0.3, 0.5)}  # share of items hit, of their right answers lost
CHUNK_ANSWERS = 4_000_000  # runs x items x trials simulated at once


def _noise_rates(acc: float) -> tuple[float, float]:
    """Per-trial loss and gain probabilities on fragile items, equal in expected answers."""
    loss = min(0.05, 0.5 * (1 - acc) / acc)
    return loss, loss * acc / (1 - acc)


def simulate(model: str, items: int, trials: int, acc: float, drop: float, runs: int,
             rng: np.random.Generator, heterogeneity: float | None = HETEROGENEITY):
    """(config - baseline) per run, item and trial as int8 [runs, items, trials], and the true
    difference. heterogeneity None: every item at p = acc."""
    shape = (runs, items, 1)
    p = (np.full(shape, acc) if heterogeneity is None else
         rng.beta(acc * heterogeneity, (1 - acc) * heterogeneity, size=shape))
    draws = 1 if model == "greedy" else trials
    base = rng.random((runs, items, draws)) < p
    broken = rng.random(shape) < drop / acc if model.endswith("items") or model == "greedy" else None
    if model.startswith("same") or model == "greedy":
        loss, gain = _noise_rates(acc)
        fragile = rng.random(shape) < FRAGILE
        flip = rng.random((runs, items, draws))
        cfg = base ^ ((base & fragile & (flip < loss)) | (~base & fragile & (flip < gain)))
        if broken is None:
            cfg &= rng.random(cfg.shape) >= drop / acc
    else:
        keep = 1 - drop / acc if broken is None else 1.0
        cfg = rng.random((runs, items, draws)) < p * keep
    if broken is not None:
        cfg &= ~broken
    truth = -drop
    if model in SHOCKS:
        share, lost = SHOCKS[model]
        shocked = np.arange(draws)[None, None, :] == rng.integers(0, draws, size=(runs, 1, 1))
        hit = (rng.random((runs, items, draws)) < share) & shocked & (rng.random((runs, items, draws)) < lost)
        cfg &= ~hit  # the truth stays the config's own difference: the shock is a fault of one trial
    if draws != trials:
        base, cfg = np.repeat(base, trials, axis=2), np.repeat(cfg, trials, axis=2)
    return cfg.astype(np.int8) - base.astype(np.int8), truth


def judge(x: np.ndarray, margin: float = MARGIN) -> dict:
    """moebench's verdict on each simulated run (x: [runs, items, trials] of -1, 0, 1)."""
    runs, items, trials = x.shape
    n = items * trials
    gain, loss = (x > 0).sum(axis=(1, 2)).astype(float), (x < 0).sum(axis=(1, 2)).astype(float)
    item_diff = x.sum(axis=2, dtype=np.int64)
    deff = (design_effect(item_diff, np.full(item_diff.shape, float(trials)), gain, loss)
            if trials > 1 else np.ones(runs))
    lo, hi = tango_interval(gain / deff, loss / deff, n / deff)
    est = (gain - loss) / n
    flagged = np.zeros(runs, dtype=bool)
    if trials > 1:
        check = trial_check(x)
        lo, hi = with_trial_component(est, lo, hi, check["trial_variance"])
        flagged = check["flagged"]
    lo = with_item_floor(est, lo, items)
    return {"lower": lo, "upper": hi, "flagged": flagged, "verdict": decide(lo, hi, margin, flagged),
            "detectable": detectable_drop(n, items, (gain + loss) / n, deff, margin),
            "discordant": gain + loss}


def cell(model, items, trials, acc, drop, runs, rng, margin=MARGIN, heterogeneity=HETEROGENEITY) -> dict:
    """One grid cell's rates over `runs` runs (simulated in chunks)."""
    parts, truth = [], 0.0
    chunk = max(1, CHUNK_ANSWERS // (items * trials))
    for done in range(0, runs, chunk):
        x, truth = simulate(model, items, trials, acc, drop, min(chunk, runs - done), rng, heterogeneity)
        parts.append(judge(x, margin))
    j = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    v = j["verdict"]
    return {"model": model, "items": items, "trials": trials, "accuracy": acc, "drop_points": drop * 100,
            "runs": runs, "discordant_per_run": float(j["discordant"].mean()),
            "coverage": float(np.mean((j["lower"] <= truth + 1e-12) & (truth - 1e-12 <= j["upper"]))),
            **{VERDICTS[k]: float(np.mean(v == k)) for k in (1, 2, 3)},
            "fail": float(np.mean(v != 1)), "flagged": float(j["flagged"].mean()),
            "detectable_points": float(np.nanmedian(j["detectable"]) * 100) if np.isfinite(j["detectable"]).any()
            else None}


def shapes(models, items_grid, trials_grid, acc_grid):
    """(model, items, trials, accuracy) of every cell; models that need trials skip one."""
    for model in models:
        for items in items_grid:
            for trials in trials_grid:
                if trials == 1 and model in MULTI_TRIAL_ONLY:
                    continue
                for acc in acc_grid:
                    yield model, items, trials, acc


def grid(runs: int, rng: np.random.Generator, items_grid=ITEMS, trials_grid=TRIALS, acc_grid=ACCURACY,
         drops=DROPS, models=MODELS, echo=print) -> list[dict]:
    rows = []
    echo("model           items trials  acc drop  discord  cover  non-inf  regr  incon  fail  flag  mde")
    for model, items, trials, acc in shapes(models, items_grid, trials_grid, acc_grid):
        for drop in drops:
            r = cell(model, items, trials, acc, drop, runs, rng)
            rows.append(r)
            mde = "  n/a" if r["detectable_points"] is None else f"{r['detectable_points']:5.2f}"
            echo(f"{model:15s} {items:5d} {trials:6d} {acc:4.2f} {drop * 100:4.1f} "
                 f"{r['discordant_per_run']:8.1f} {r['coverage']:6.3f} {r['non-inferior']:7.3f} "
                 f"{r['regression']:5.3f} {r['inconclusive']:6.3f} {r['fail']:5.3f} "
                 f"{r['flagged']:5.3f} {mde}")
    return rows


def power_check(runs: int, rng: np.random.Generator, items_grid=ITEMS, trials_grid=TRIALS,
                acc_grid=ACCURACY, models=MODELS[:5], echo=print) -> list[dict]:
    """The median detectable drop printed by runs with no true drop, then the regression rate at
    that drop in the same model (target: >= 80%)."""
    rows = []
    for model, items, trials, acc in shapes(models, items_grid, trials_grid, acc_grid):
        printed = cell(model, items, trials, acc, 0.0, runs, rng)["detectable_points"]
        if printed is None or printed / 100 > 0.9 * acc:
            continue  # nothing printed, or a drop the model cannot lose
        at = cell(model, items, trials, acc, printed / 100, runs, rng)
        rows.append({"model": model, "items": items, "trials": trials, "accuracy": acc,
                     "printed_drop_points": printed, "regression": at["regression"], "runs": runs})
        echo(f"{model:15s} {items:5d} items x {trials} trials, acc {acc:.2f}: printed drop "
             f"{printed:5.2f} points, regression at it {at['regression']:.3f}")
    return rows


PLAN_CASES = (  # (accuracy, trials, margin in points, heterogeneity, discordance told to plan)
    (0.9, 1, 1.0, None, None),
    (0.75, 5, 2.0, None, None),
    (0.9, 3, 1.0, HETEROGENEITY, 2 * 0.9 * 0.1 * HETEROGENEITY / (HETEROGENEITY + 1)),
)


def plan_check(runs: int, rng: np.random.Generator, echo=print) -> list[dict]:
    """`moebench plan`'s items for 80% assurance of non-inferiority when nothing changed, run in
    the diverged model it assumes (target: 75-90% non-inferior)."""
    rows = []
    for acc, trials, margin, het, psi in PLAN_CASES:
        items = items_for_margin(margin / 100, acc, trials, discordance=psi)["diverged"]
        r = cell("diverged-spread", items, trials, acc, 0.0, runs, rng, margin / 100, het)
        rows.append({"accuracy": acc, "trials": trials, "margin": margin, "items": items,
                     "items_heterogeneous": het is not None, "discordance_told": psi,
                     "non_inferior": r["non-inferior"], "runs": runs})
        echo(f"acc {acc:.2f}, {trials} trials, margin {margin:g}, "
             f"{'U-shaped items, discordance told' if het else 'items alike'}: plan says {items} items; "
             f"non-inferior in {r['non-inferior']:.3f} of runs")
    return rows


def summarise(rows: list[dict], slack: float = 0.03) -> list[str]:
    """The grid against the verdict's targets (docs/statistics.md), one line each."""
    plain = [r for r in rows if not r["model"].startswith("shock")]
    shocks = [r for r in rows if r["model"].startswith("shock")]
    busy = [r for r in plain if r["discordant_per_run"] >= 8]
    at_margin = [r for r in plain if abs(r["drop_points"] - MARGIN * 100) < 1e-9]
    at_zero = [r for r in plain if r["drop_points"] == 0]
    shock_misses = [r for r in shocks if r["coverage"] < 0.90 and not (r["flagged"] >= 0.9 and r["non-inferior"] == 0)]
    reversals = []
    for key in {(r["model"], r["trials"], r["accuracy"]) for r in rows}:
        for drop, sign in ((0.5, -1), (3.0, 1)):
            fails = [r["fail"] for r in sorted(rows, key=lambda r: r["items"])
                     if (r["model"], r["trials"], r["accuracy"]) == key and r["drop_points"] == drop]
            reversals += [(key, drop, fails) for a, b in zip(fails, fails[1:]) if sign * (b - a) < -slack]
    worst = lambda xs, k, f: f(xs, key=lambda r: r[k])  # noqa: E731
    return [
        f"coverage, no shock, >= 8 discordant pairs per run: {min(r['coverage'] for r in busy):.3f}-"
        f"{max(r['coverage'] for r in busy):.3f} over {len(busy)} cells (lowest: {_where(worst(busy, 'coverage', min))})",
        f"coverage, no shock, every cell: lowest {min(r['coverage'] for r in plain):.3f} over {len(plain)} cells",
        f"non-inferior at a true drop of the margin: at most {max(r['non-inferior'] for r in at_margin):.3f} "
        f"({_where(worst(at_margin, 'non-inferior', max))})",
        f"regression at no true drop: at most {max(r['regression'] for r in at_zero):.3f} "
        f"({_where(worst(at_zero, 'regression', max))})",
        f"trial shocks: {len(shocks) - len(shock_misses)} of {len(shocks)} cells cover >= 0.90 or flag >= 0.90 with "
        f"no non-inferior verdict" + "".join(f"; short: {_where(r)} coverage {r['coverage']:.3f}, flagged "
                                            f"{r['flagged']:.3f}" for r in shock_misses),
        f"fail rate over items (0.5-point drop never rising, 3-point never falling, beyond {slack}): "
        f"{len(reversals)} reversals" + "".join(f"; {k} {d}: {f}" for k, d, f in reversals[:5]),
    ]


def _where(r: dict) -> str:
    return (f"{r['model']}, {r['items']} items x {r['trials']} trials, accuracy {r['accuracy']}, "
            f"drop {r['drop_points']:g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--power", action="store_true", help="the regression rate at the printed detectable drop")
    ap.add_argument("--plan", action="store_true", help="moebench plan's items against simulation")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    echo = lambda line: print(line, flush=True)  # noqa: E731
    if args.power:
        rows = power_check(args.runs, rng, echo=echo)
    elif args.plan:
        rows = plan_check(args.runs, rng, echo=echo)
    else:
        rows = grid(args.runs, rng, echo=echo)
        for line in summarise(rows):
            echo(line)
    print(f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"runs": args.runs, "seed": args.seed, "margin_points": MARGIN * 100, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
