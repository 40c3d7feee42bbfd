"""Coverage of the paired accuracy intervals, and the power the detectable drop promises, by
simulation at the run sizes moebench uses (docs/statistics.md has the figures).

A simulated run: `items` items drawn from a population; item i has a baseline success
probability p_i ~ Beta(acc k, (1 - acc) k) (k = 2: most items nearly always right or nearly
always wrong, as a good model's are), and is answered in `trials` trials. Two ways the config's
answers relate to the baseline's:

  shared  the two configs share each trial's seed, so the config gives the baseline's answer
          except on "fragile" items (a fifth of them), where it loses a right answer or gains a
          wrong one with fixed probabilities per trial: discordance clustered in items, the case
          of an approximate optimization sampled with the same seeds;
  indep   the config's answers are independent draws at p_i (1 - drop / acc): discordance
          spread over every trial, the case of a config whose outputs all differ.
  repeat  as shared, but every trial repeats trial 0 (greedy decoding): trials add nothing.

The true difference is the population one (expected over items and trials). For each cell the
script reports how often each method's 95% interval covers it:

  score      moebench's: Tango's score interval, with the Rao-Scott design effect over trials
  item-t     Student t on the per-item mean differences (n - 1 degrees of freedom)
  pooled     the score interval on all (item, trial) pairs as if independent (what clustering fixes)
  bootstrap  the paired percentile bootstrap of trial 0 (moebench's until 2026-12-02; one trial)

and, for drops, how often the run would be called a regression (score interval below 0) beside
the mean detectable drop the run reported.

    python benchmarks/paired_accuracy_coverage.py [--runs 10000] [--seed 0] [--out FILE.json]
    python benchmarks/paired_accuracy_coverage.py --power   # power at the planned drop
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from scipy.stats import t as student_t

from moebench.results.paired_accuracy import design_effect, detectable_drop, tango_interval

ITEMS = (48, 200)
TRIALS = (1, 3, 5)
ACCURACY = (0.6, 0.8, 0.9, 0.95, 0.99)
DROPS = (0.0, 0.01, 0.03)
MODES = ("shared", "indep", "repeat")
FRAGILE = 0.2
HETEROGENEITY = 2.0
BOOT = 1000


def _rates(acc: float, drop: float) -> tuple[float, float]:
    """Per-trial loss and gain rates for the shared mode: gains as large as the wrong answers of
    fragile items allow (at most 1 point), losses the gain plus the drop."""
    gain = min(0.01, 0.5 * FRAGILE * (1 - acc))
    return gain + drop, gain


def simulate(items: int, trials: int, acc: float, drop: float, mode: str, runs: int,
             rng: np.random.Generator) -> dict:
    """Outcome counts of `runs` simulated runs: per item summed difference and paired trials, and
    trial 0's gain and loss counts."""
    p = rng.beta(acc * HETEROGENEITY, (1 - acc) * HETEROGENEITY, size=(runs, items, 1))
    draws = 1 if mode == "repeat" else trials
    u = rng.random((runs, items, draws))
    base = u < p
    if mode == "indep":
        cfg = rng.random((runs, items, draws)) < p * (1 - drop / acc)
    else:
        loss, gain = _rates(acc, drop)
        fragile = rng.random((runs, items, 1)) < FRAGILE
        flip = rng.random((runs, items, draws))
        down = base & fragile & (flip < loss / (FRAGILE * acc))
        up = ~base & fragile & (flip < gain / (FRAGILE * (1 - acc)))
        cfg = base ^ (down | up)
    if mode == "repeat":
        base, cfg = np.repeat(base, trials, axis=2), np.repeat(cfg, trials, axis=2)
    g, l_ = (cfg & ~base), (base & ~cfg)
    return {"diff": (g.astype(np.int16) - l_).sum(axis=2), "gain": g.sum(axis=(1, 2)),
            "loss": l_.sum(axis=(1, 2)), "gain0": g[:, :, 0].sum(axis=1), "loss0": l_[:, :, 0].sum(axis=1)}


def intervals(sim: dict, items: int, trials: int, rng: np.random.Generator) -> dict:
    n = items * trials
    gain, loss = sim["gain"].astype(float), sim["loss"].astype(float)
    pairs = np.full(sim["diff"].shape, float(trials))
    deff = design_effect(sim["diff"], pairs, gain, loss) if trials > 1 else np.ones_like(gain)
    out = {"score": tango_interval(gain / deff, loss / deff, n / deff),
           "pooled": tango_interval(gain, loss, n)}
    d = sim["diff"] / trials
    half = student_t.ppf(0.975, items - 1) * d.std(axis=1, ddof=1) / np.sqrt(items)
    out["item-t"] = (d.mean(axis=1) - half, d.mean(axis=1) + half)
    if trials == 1:
        g0, l0 = sim["gain0"].astype(float), sim["loss0"].astype(float)
        probs = np.stack([g0, l0, items - g0 - l0], axis=1) / items
        counts = np.stack([rng.multinomial(items, pr, size=BOOT) for pr in probs])
        reps = (counts[:, :, 0] - counts[:, :, 1]) / items
        out["bootstrap"] = tuple(np.quantile(reps, [0.025, 0.975], axis=1))
    out["mde"] = detectable_drop(n / deff, (gain + loss) / n)
    return out


def cell(items, trials, acc, drop, mode, runs, rng) -> dict:
    sim = simulate(items, trials, acc, drop, mode, runs, rng)
    ci = intervals(sim, items, trials, rng)
    truth = -drop
    row = {"items": items, "trials": trials, "accuracy": acc, "drop_points": drop * 100, "mode": mode,
           "runs": runs, "discordant_per_run": float(np.mean(sim["gain"] + sim["loss"]))}
    for name in ("score", "item-t", "pooled", "bootstrap"):
        if name in ci:
            lo, hi = ci[name]
            row[name] = float(np.mean((lo <= truth + 1e-12) & (truth - 1e-12 <= hi)))
    lo, hi = ci["score"]
    row["regression_share"] = float(np.mean(hi < 0))
    row["mean_detectable_drop_points"] = float(np.nanmean(ci["mde"]) * 100)
    return row


def power_check(runs: int, rng: np.random.Generator) -> list[dict]:
    """One trial, shared mode: the drop the run's own formula calls detectable at the cell's true
    discordance, and how often the score interval then lies below 0 (target: 80%)."""
    rows = []
    for items in ITEMS:
        for acc in (0.8, 0.9, 0.99):
            gain = _rates(acc, 0.0)[1]
            drop = 0.0
            for _ in range(50):  # the discordance grows with the drop: iterate to the fixed point
                drop = float(detectable_drop(items, 2 * gain + drop))
            if drop + gain > FRAGILE * acc:
                continue  # the model cannot lose that much
            sim = simulate(items, 1, acc, drop, "shared", runs, rng)
            lo, hi = tango_interval(sim["gain"], sim["loss"], items)
            rows.append({"items": items, "accuracy": acc, "planned_drop_points": drop * 100,
                         "power": float(np.mean(hi < 0)), "runs": runs})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--power", action="store_true", help="check the power at the planned drop instead")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    if args.power:
        rows = power_check(args.runs, rng)
        for r in rows:
            print(f"{r['items']:4d} items  acc {r['accuracy']:.2f}  planned drop {r['planned_drop_points']:5.2f} "
                  f"points  power {r['power']:.3f}")
    else:
        rows = []
        print("items trials  acc  drop  mode    discord  score item-t pooled  boot   regr  mde")
        for items in ITEMS:
            for trials in TRIALS:
                for mode in MODES:
                    if mode == "repeat" and trials == 1:
                        continue
                    for acc in ACCURACY:
                        for drop in DROPS:
                            chunk = max(1, min(args.runs, 4_000_000 // (items * trials)))
                            parts = [cell(items, trials, acc, drop, mode, min(chunk, args.runs - done), rng)
                                     for done in range(0, args.runs, chunk)]
                            r = {k: (float(np.average([p[k] for p in parts], weights=[p["runs"] for p in parts]))
                                     if isinstance(parts[0][k], float) else parts[0][k]) for k in parts[0]}
                            r["runs"] = args.runs
                            rows.append(r)
                            print(f"{items:5d} {trials:6d} {acc:5.2f} {drop * 100:4.0f}  {mode:6s} "
                                  f"{r['discordant_per_run']:8.1f} {r['score']:6.3f} {r['item-t']:6.3f} "
                                  f"{r['pooled']:6.3f} {r.get('bootstrap', float('nan')):6.3f} "
                                  f"{r['regression_share']:6.3f} {r['mean_detectable_drop_points']:5.2f}",
                                  flush=True)
    print(f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"runs": args.runs, "seed": args.seed, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
