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

- Trials are checked, not assumed exchangeable (trial_check): when the per-trial differences
  vary more than sampling items explains, that excess widens the interval, and a significant one
  is flagged (the verdict then cannot be non-inferior).

The detectable drop is the smallest true drop the run would call a regression with 80% power,
with the discordance the drop itself adds, in the worst of the answer models (detectable_drop).

numpy only at import (scipy's normal quantiles come in lazily); every function takes arrays, so
the coverage simulation runs the same code the summary does.
"""

from __future__ import annotations

import math

import numpy as np

ALPHA = 0.05
POWER = 0.80
TRIAL_ALPHA = 0.01  # per-trial differences flagged as not exchangeable below this p
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


def detectable_drop(pairs, items, discordance, deff=1.0, margin=0.0, alpha: float = ALPHA,
                    power: float = POWER):
    """Smallest true drop (a fraction) that a run of this shape calls a `regression` (its interval
    below 0 and reaching -margin or further) with probability >= `power`, in every answer model.

    The estimate's variance under a drop d is the run's own noise (its discordance, divided among
    pairs / deff effective pairs, widened by the trial component's mean share, trial_widening)
    plus what the drop itself adds. A drop adds the most when it
    sits in whole items (an item lost in every trial): d (1 - d) / items, which a drop spread over
    trials never exceeds. So d is detected once d >= (z(1 - alpha/2) + z(power)) sqrt(V(d)). A
    regression also needs the interval to reach -margin, which it does in >= 97.5% of runs once
    the drop is the margin (the two events move together: the joint power is the smaller), so the
    figure is never below the margin. nan where no drop is detectable at that power: fewer than 20
    items, or not even a drop of 100% would be. Simulated in four answer models, benchmarks/
    paired_accuracy_coverage.py --power (docs/statistics.md)."""
    n, m, psi0, deff, margin = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in
                                                     (pairs, items, discordance, deff, margin)))
    k = _z(1 - alpha / 2) + _z(power)
    with np.errstate(divide="ignore", invalid="ignore"):
        widening = 1 + trial_widening(np.rint(np.where(m > 0, n / m, 1)))
        noise = np.where(n > 0, deff * psi0 / n * widening, np.inf)

        def short(d):  # > 0 while d is too small to be detected
            return k * np.sqrt(noise + d * (1 - d) / m) - d

        lo, hi = np.zeros_like(n), np.ones_like(n)
        for _ in range(_BISECTIONS):
            mid = (lo + hi) / 2
            undetected = short(mid) > 0
            lo, hi = np.where(undetected, mid, lo), np.where(undetected, hi, mid)
        ok = (m >= MIN_ITEMS_FOR_POWER) & (n > 0) & (short(np.full_like(n, 0.999)) <= 0)
    return np.where(ok, np.maximum(hi, margin), np.nan)


def trial_widening(trials):
    """The mean share by which the trial component widens the interval's variance when trials are
    exchangeable: E[max(0, X / k - 1)], X ~ chi-square(k), k = trials - 1 (0 for one trial), i.e.
    P(chi2(k + 2) > k) - P(chi2(k) > k). With answers that diverge it is the whole excess (0.37
    at 3 trials, 0.27 at 5); where the noise sits in whole items the trial part is smaller."""
    from scipy.stats import chi2

    k = np.maximum(np.asarray(trials, dtype=float) - 1, 0)
    safe = np.maximum(k, 1)
    return np.where(k > 0, chi2.sf(safe, safe + 2) - chi2.sf(safe, safe), 0.0)


MIN_ITEMS_FOR_POWER = 20  # below it the normal approximation above promises power the score test lacks


def identical_bound(items: int, alpha: float = ALPHA) -> float:
    """The most items (a share) that could change with no change among `items` seen, one-sided at
    1 - alpha (Clopper-Pearson; about 3 / items at 95%). What `identical` certifies: the sample is
    unchanged, and a population change larger than this would have shown in it."""
    return float(1 - alpha ** (1 / items)) if items > 0 else math.nan


def trial_check(item_trial_diff, alpha: float = TRIAL_ALPHA) -> dict:
    """Do the per-trial paired differences vary more than sampling items explains?

    item_trial_diff: config right - baseline right, shape [..., items, trials], items with every
    trial paired. Under exchangeable trials each item's trial labels can be permuted freely; the
    statistic Q = (T - 1) sum_t (S_t - S)^2 / sum_i sum_t (x_it - x_i)^2 (S_t: trial t's total;
    Cochran's Q for values in {-1, 0, 1}) has mean T - 1 under that permutation, and is referred
    to chi-square with T - 1 degrees of freedom. Also returns the between-trial variance of the
    mean difference beyond what the permutation explains (a fraction squared, for widening the
    interval: the trial component), and the trial that stands out most."""
    x = np.asarray(item_trial_diff, dtype=float)
    items, trials = x.shape[-2], x.shape[-1]
    from scipy.stats import chi2

    totals = x.sum(axis=-2)
    between = ((totals - totals.mean(axis=-1, keepdims=True)) ** 2).sum(axis=-1)
    within = ((x - x.mean(axis=-1, keepdims=True)) ** 2).sum(axis=(-2, -1))
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(within > 0, (trials - 1) * between / within, 0.0)
        excess = np.maximum(between - within, 0.0) / max(trials - 1, 1) / (items * items * trials)
    p = chi2.sf(q, max(trials - 1, 1)) if trials > 1 else np.ones_like(q)
    standout = np.abs(totals - totals.mean(axis=-1, keepdims=True)).argmax(axis=-1)
    return {"q": q, "p": p, "flagged": (p < alpha) & (trials > 1), "trial_variance": excess,
            "standout": standout, "per_trial": totals / max(items, 1)}


def with_trial_component(estimate, lower, upper, trial_variance, alpha: float = ALPHA):
    """The interval widened on each side, in quadrature, by z times the standard error that the
    trials' excess variance adds to their mean (trial_check's trial_variance); arrays broadcast."""
    extra = _z(1 - alpha / 2) ** 2 * np.asarray(trial_variance, dtype=float)
    est = np.asarray(estimate, dtype=float)
    lo = est - np.sqrt((est - np.asarray(lower, dtype=float)) ** 2 + extra)
    hi = est + np.sqrt((np.asarray(upper, dtype=float) - est) ** 2 + extra)
    return np.maximum(lo, -1.0), np.minimum(hi, 1.0)


def with_item_floor(estimate, lower, items, alpha: float = ALPHA):
    """The lower end at least z^2 / (items + z^2) below the estimate: the share of items that could
    be broken in every trial and still show no broken one among `items` (the score bound of 0 in
    items). Trials cannot lower it: more trials of the same items reveal nothing about items not
    in the run, and a drop that sits in a few whole items leaves too few clusters to estimate the
    design effect from. With one trial the score interval already reaches about as far."""
    z2 = _z(1 - alpha / 2) ** 2
    floor = np.asarray(estimate, dtype=float) - z2 / (np.asarray(items, dtype=float) + z2)
    return np.maximum(np.minimum(np.asarray(lower, dtype=float), floor), -1.0)


def _item_trial_matrix(codes, trial_index, diff):
    """[items, trials] paired differences of the items answered in every trial (None if fewer
    than 2 trials or 2 such items)."""
    _, tcodes = np.unique(np.asarray(trial_index), return_inverse=True)
    items, trials = int(codes.max()) + 1, int(tcodes.max()) + 1
    if trials < 2:
        return None
    x = np.zeros((items, trials))
    seen = np.zeros((items, trials), dtype=bool)
    x[codes, tcodes] = diff
    seen[codes, tcodes] = True
    full = seen.all(axis=1)
    return x[full] if full.sum() >= 2 else None


def paired_difference(item_index, base_correct, config_correct, trial_index=None,
                      alpha: float = ALPHA) -> dict:
    """Accuracy difference config - baseline over every (item, trial) pair both configs answered,
    clustered by item. item_index: an integer code of the item for each pair; trial_index: its
    trial (None: one trial each).

    With several trials the interval also carries the trial component: the between-trial variance
    of the per-trial differences beyond what sampling items explains (trial_check), added to each
    side in quadrature; `trials_flagged` says when that excess is significant.

    Returns fractions: estimate, lower, upper; counts: items, pairs, gain, loss, trials (the most
    paired trials of an item); design_effect, discordance (share of pairs discordant), the trial
    check (trial_p, trials_flagged, standout_trial, per_trial) and method."""
    idx = np.asarray(item_index, dtype=np.int64)
    b = np.asarray(base_correct, dtype=bool)
    c = np.asarray(config_correct, dtype=bool)
    if idx.size == 0:
        return {"estimate": math.nan, "lower": math.nan, "upper": math.nan, "items": 0, "pairs": 0,
                "gain": 0, "loss": 0, "trials": 0, "design_effect": math.nan, "discordance": math.nan,
                "trial_p": None, "trials_flagged": False, "standout_trial": None, "per_trial": None,
                "method": None}
    _, codes = np.unique(idx, return_inverse=True)
    pair_diff = c.astype(float) - b.astype(float)
    diff = np.bincount(codes, weights=pair_diff)
    pairs = np.bincount(codes).astype(float)
    gain, loss = int(np.sum(c & ~b)), int(np.sum(b & ~c))
    trials = int(pairs.max())
    deff = float(design_effect(diff, pairs, gain, loss)) if trials > 1 else 1.0
    n = float(idx.size)
    lo, hi = (float(v) for v in tango_interval(gain / deff, loss / deff, n / deff, alpha))
    est = (gain - loss) / n
    out = {"trial_p": None, "trials_flagged": False, "standout_trial": None, "per_trial": None}
    matrix = _item_trial_matrix(codes, trial_index, pair_diff) if trial_index is not None else None
    if matrix is not None:
        check = trial_check(matrix)
        labels = np.unique(np.asarray(trial_index))
        lo, hi = (float(v) for v in with_trial_component(est, lo, hi, check["trial_variance"], alpha))
        out = {"trial_p": float(check["p"]), "trials_flagged": bool(check["flagged"]),
               "standout_trial": labels[int(check["standout"])].item(),
               "per_trial": [float(v) for v in check["per_trial"]]}
    lo = float(with_item_floor(est, lo, pairs.size, alpha))
    return {"estimate": est, "lower": lo, "upper": min(hi, 1.0), "items": int(pairs.size),
            "pairs": int(n), "gain": gain, "loss": loss, "trials": trials, "design_effect": deff,
            "discordance": (gain + loss) / n, **out,
            "method": TANGO if trials == 1 else CLUSTERED.format(trials=trials)}


# ---------------------------------------------------------------- planning a run

def planned_drop(items: int, baseline_accuracy: float, trials: int = 1, margin: float = 0.0,
                 discordance: float | None = None, alpha: float = ALPHA, power: float = POWER) -> dict:
    """The drop a run of this shape would call a regression with `power`, before it runs
    (fractions), in two answer models:

    same_seed: the config's outputs equal the baseline's except where it changes them (a shared
               seed, greedy decoding, an exact-ish change), so pairs differ only by the drop, and
               the drop may sit in whole items, which more trials cannot reveal;
    diverged:  its answers differ from the baseline's like independent samples at the baseline's
               accuracy p (2 p (1 - p) of pairs discordant; `discordance` replaces that figure,
               e.g. from a pilot run), independently from trial to trial."""
    p = float(baseline_accuracy)
    psi = 2 * p * (1 - p) if discordance is None else float(discordance)
    same = detectable_drop(items * trials, items, 0.0, trials, margin, alpha, power)
    diverged = detectable_drop(items * trials, items, psi, 1.0, margin, alpha, power)
    return {"same_seed": float(same), "diverged": float(diverged), "discordance": psi}


def items_for_margin(margin: float, baseline_accuracy: float, trials: int = 1,
                     discordance: float | None = None, deff: float = 1.0, alpha: float = ALPHA,
                     power: float = POWER) -> dict:
    """Items a run needs for a `non-inferior` verdict at `margin` (a fraction) with probability
    `power` when accuracy truly did not change, in the models of planned_drop:

    same_seed: no answer changes: the score interval of 0 discordant pairs in n items reaches
               -z^2 / (n + z^2), so n > z^2 (1 - margin) / margin (then the verdict is certain);
    diverged:  the interval's lower end, about -z sqrt(V) from an estimate of 0 that varies by
               sqrt(V), V = psi deff (1 + trial_widening) / (n trials), must clear -margin in
               `power` of runs: n = (z(1 - alpha/2) + z(power))^2 psi deff (1 + w) / (margin^2
               trials). deff: the design effect a pilot run showed (1: trials independent)."""
    p = float(baseline_accuracy)
    psi = 2 * p * (1 - p) if discordance is None else float(discordance)
    za, zb = _z(1 - alpha / 2), _z(power)
    same = math.floor(za * za * (1 - margin) / margin) + 1
    spread = psi * deff * (1 + float(trial_widening(trials)))
    diverged = math.ceil((za + zb) ** 2 * spread / (margin * margin * trials))
    return {"same_seed": int(same), "diverged": int(max(diverged, same)), "discordance": psi}
