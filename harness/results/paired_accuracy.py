"""The paired accuracy difference (config minus baseline) with a 95% interval, clustered by item,
and the smallest drop a run could detect.

Two configs answer the same items; under sampling each item is answered in several trials, and
trial t of both configs draws from the same seed (run seed, trial, item), so the unit of pairing
is (item, trial) and the unit of independence is the item. The methods, and why (coverage
measured by benchmarks/paired_accuracy_coverage.py, figures in docs/statistics.md):

- One trial: Tango's (1998) score interval for the difference of two paired proportions. It
  stays near 95% where a good model's pairs sit: few discordant pairs, or none. A Wald or
  Student-t interval on the item differences collapses to [0, 0] with no discordant pair, and a
  paired bootstrap does the same: both cover far too rarely at high accuracy.
- Several trials: the same score interval on counts divided by a design effect (Rao and Scott,
  1992): deff = the variance of the difference estimated from the item totals / the variance it
  would have if every (item, trial) pair were independent, kept within [1, trials]. Greedy
  trials that repeat the same answers give deff = trials, i.e. exactly the one-trial interval;
  trials with independent sampling noise give deff near 1. With no discordant pair at all there
  is nothing to estimate deff from, and it is taken as the number of trials: any drop could have
  sat in whole items, which more trials of the same items cannot reveal.

The detectable drop is Connor's (1987) sample size formula for McNemar's test, solved for the
difference: the smallest drop d with d sqrt(n) >= z(1 - alpha/2) sqrt(psi) + z(power)
sqrt(psi - d^2), n the effective number of pairs (pairs / deff) and psi the discordance rate,
at least d (a drop of d needs at least d of the pairs discordant).

numpy only at import (scipy's normal quantiles come in lazily); every function takes arrays, so
the coverage simulation runs the same code the summary does.
"""

from __future__ import annotations

import math

import numpy as np

ALPHA = 0.05
POWER = 0.80
_BISECTIONS = 60  # halves [-1, 1] to below 1e-17: past double precision on the difference

TANGO = "Tango score interval for paired proportions (one trial per item)"
CLUSTERED = ("Tango score interval on counts divided by the design effect of clustering by item "
             "(Rao-Scott), over {trials} trials per item")


def _z(q: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(q))


def _score_gap(delta, gain, loss, n, z):
    """(gain - loss - n delta) + z sqrt(n V(delta)): Tango's score statistic times its standard
    error, shifted by z standard errors. V is the variance of the difference under the
    constraint, from the restricted maximum-likelihood share of baseline-only pairs."""
    b = -gain - loss + (2 * n - gain + loss) * delta
    c = -loss * delta * (1 - delta)
    disc = np.maximum(b * b - 8 * n * c, 0.0)
    q = (np.sqrt(disc) - b) / (4 * n)
    var = np.maximum(2 * q + delta * (1 - delta), 0.0)
    return (gain - loss - n * delta) + z * np.sqrt(n * var)


def tango_interval(gain, loss, n, alpha: float = ALPHA):
    """Score interval of (gain - loss) / n, the paired difference of two proportions.

    gain: pairs right only for the config; loss: right only for the baseline; n: all pairs.
    Counts may be fractional (effective counts after a design effect) and arrays (broadcast).
    Returns (lower, upper) as fractions; nan where n is 0."""
    gain, loss, n = (np.asarray(v, dtype=float) for v in (gain, loss, n))
    gain, loss, n = np.broadcast_arrays(gain, loss, n)
    z = _z(1 - alpha / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        centre = np.where(n > 0, (gain - loss) / np.where(n > 0, n, 1), np.nan)
        bounds = []
        for z_signed, edge in ((-z, -1.0), (z, 1.0)):
            # The lower end is where the statistic reaches +z: there the gap with -z crosses 0,
            # and it is <= 0 between that end and the estimate. The upper end mirrors it.
            outer = np.full_like(centre, edge)
            inner = centre.copy()
            for _ in range(_BISECTIONS):
                mid = (outer + inner) / 2
                gap = _score_gap(mid, gain, loss, n, z_signed)
                inside = gap <= 0 if z_signed < 0 else gap >= 0
                inner, outer = np.where(inside, mid, inner), np.where(inside, outer, mid)
            bound = np.where(centre == edge, edge, (outer + inner) / 2)
            bounds.append(np.where(n > 0, bound, np.nan))
    return bounds[0], bounds[1]


def design_effect(item_diff, item_pairs, gain, loss):
    """Rao-Scott design effect of clustering pairs by item, kept within [1, largest cluster].

    item_diff: per item, (config right) - (baseline right) summed over its paired trials, shape
    [..., items]; item_pairs: paired trials per item (same shape); gain, loss: their totals over
    all items ([...]). No discordant pair: the largest cluster (see the module doc)."""
    d = np.asarray(item_diff, dtype=float)
    m = np.asarray(item_pairs, dtype=float)
    items = (m > 0).sum(axis=-1)
    total = m.sum(axis=-1)
    largest = m.max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        est = d.sum(axis=-1) / total
        resid = d - est[..., None] * m
        var_cluster = items / (items - 1) * (resid * resid).sum(axis=-1) / total ** 2
        psi = (np.asarray(gain, float) + np.asarray(loss, float)) / total
        var_pairs = (psi - est * est) / total
        deff = np.where(var_pairs > 0, var_cluster / var_pairs, largest)
    return np.clip(np.nan_to_num(deff, nan=1.0), 1.0, np.maximum(largest, 1.0))


def detectable_drop(pairs, discordance, alpha: float = ALPHA, power: float = POWER):
    """Smallest true drop (a fraction) that McNemar's test at `alpha` (two-sided) detects with
    `power`, given effective pairs and a discordance rate (Connor's formula, psi >= the drop)."""
    n = np.asarray(pairs, dtype=float)
    psi0 = np.asarray(discordance, dtype=float)
    n, psi0 = np.broadcast_arrays(n, psi0)
    za, zb = _z(1 - alpha / 2), _z(power)

    def short(d):  # > 0 while d is too small to be detected
        psi = np.maximum(psi0, d)
        return za * np.sqrt(psi) + zb * np.sqrt(np.maximum(psi - d * d, 0.0)) - d * np.sqrt(n)

    lo, hi = np.zeros_like(n), np.ones_like(n)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        undetected = short(mid) > 0
        lo, hi = np.where(undetected, mid, lo), np.where(undetected, hi, mid)
    # Below ~8 pairs not even a drop of 100% reaches the power: nothing is detectable.
    return np.where((n > 0) & (short(np.ones_like(n)) <= 0), hi, np.nan)


def paired_difference(item_index, base_correct, config_correct, alpha: float = ALPHA,
                      power: float = POWER) -> dict:
    """Accuracy difference config - baseline over every (item, trial) pair both configs answered,
    clustered by item. item_index: an integer code of the item for each pair.

    Returns fractions: estimate, lower, upper, detectable_drop; and counts: items, pairs, gain,
    loss, trials (the largest number of paired trials of an item), design_effect, method."""
    idx = np.asarray(item_index, dtype=np.int64)
    b = np.asarray(base_correct, dtype=bool)
    c = np.asarray(config_correct, dtype=bool)
    if idx.size == 0:
        return {"estimate": math.nan, "lower": math.nan, "upper": math.nan, "items": 0, "pairs": 0,
                "gain": 0, "loss": 0, "trials": 0, "design_effect": math.nan,
                "detectable_drop": math.nan, "method": None}
    _, codes = np.unique(idx, return_inverse=True)
    diff = np.bincount(codes, weights=c.astype(float) - b.astype(float))
    pairs = np.bincount(codes).astype(float)
    gain, loss = int(np.sum(c & ~b)), int(np.sum(b & ~c))
    trials = int(pairs.max())
    deff = float(design_effect(diff, pairs, gain, loss)) if trials > 1 else 1.0
    n = float(idx.size)
    lo, hi = tango_interval(gain / deff, loss / deff, n / deff, alpha)
    mde = detectable_drop(n / deff, (gain + loss) / n, alpha, power)
    return {"estimate": (gain - loss) / n, "lower": float(lo), "upper": float(hi),
            "items": int(pairs.size), "pairs": int(n), "gain": gain, "loss": loss, "trials": trials,
            "design_effect": deff, "detectable_drop": float(mde),
            "method": TANGO if trials == 1 else CLUSTERED.format(trials=trials)}


def planned_drop(items: int, baseline_accuracy: float, trials: int = 1, alpha: float = ALPHA,
                 power: float = POWER) -> dict:
    """The detectable drop before a run, in the two cases that bound it (fractions):

    rare: outputs seldom differ from the baseline's, so every discordant pair is a lost answer and
          the drop may sit in whole items (trials add nothing): n = items, psi = the drop;
    independent: the config's answers differ from the baseline's like independent samples of an
          item at the baseline's accuracy p (psi = 2 p (1 - p), the most sampling noise an item
          set with that accuracy can have) and trials are independent: n = items x trials."""
    p = float(baseline_accuracy)
    rare = detectable_drop(items, 0.0, alpha, power)
    independent = detectable_drop(items * trials, 2 * p * (1 - p), alpha, power)
    return {"rare": float(rare), "independent": float(independent)}


def items_for_margin(margin: float, baseline_accuracy: float, trials: int = 1, alpha: float = ALPHA,
                     power: float = POWER) -> dict:
    """Items a run needs for a non-inferior verdict at `margin` (a fraction) when accuracy truly
    did not change, in the same two cases as planned_drop:

    rare: no answer changes: the score interval of 0 discordant pairs in n items reaches
          -z^2 / (n + z^2), so n > z^2 (1 - margin) / margin (then the verdict is certain);
    independent: the interval's half-width z sqrt(psi / (n trials)) must fall below the margin
          with probability `power`: n = (z(1 - alpha/2) + z(power))^2 psi / (margin^2 trials)."""
    p = float(baseline_accuracy)
    za, zb = _z(1 - alpha / 2), _z(power)
    rare = math.floor(za * za * (1 - margin) / margin) + 1
    independent = math.ceil((za + zb) ** 2 * 2 * p * (1 - p) / (margin * margin * trials))
    return {"rare": int(rare), "independent": int(independent)}
