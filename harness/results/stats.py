"""Statistics for the verdict: Wilson and Student-t intervals, exact McNemar.

Throughput and speedup intervals come from trials, the unit that is repeated under the machine's
changing load: a Student t interval on the logs of the per-trial values (for a speedup, of the
per-trial paired ratios config / baseline), which has its nominal coverage for any number of
trials from 2 when the logs are roughly normal (docs/statistics.md; checked by simulation in
tests/results/test_stats.py). The paired accuracy difference and its interval: moebench.results.paired_accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.stats import binomtest
from scipy.stats import t as student_t
from statsmodels.stats.proportion import proportion_confint

Interval = tuple[float, float]
_NAN_CI: Interval = (math.nan, math.nan)


def wilson_ci(correct: int, total: int, alpha: float = 0.05) -> Interval:
    """Wilson score interval of a proportion; (nan, nan) when there is nothing to count."""
    if total <= 0:
        return _NAN_CI
    lo, hi = proportion_confint(int(correct), int(total), alpha=alpha, method="wilson")
    return float(lo), float(hi)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts b and c.

    Under "no change" each discordant pair goes either way with probability 1/2, so the
    test is a two-sided binomial test of min(b, c) out of b + c.
    """
    n = int(b) + int(c)
    if n == 0:
        return 1.0  # no discordant pairs: no evidence of any change
    return float(min(1.0, binomtest(min(int(b), int(c)), n, 0.5).pvalue))


def log_t_interval(values, alpha: float = 0.05, axis: int = -1):
    """(geometric mean, lower, upper) of positive values along `axis`: a Student t interval with
    n - 1 degrees of freedom on the mean of their logs, mapped back with exp.

    For speedups pass the per-trial paired ratios (config / baseline of the same trial): pairing
    takes the load a trial shares out of the ratio, and the t quantile (12.71 at 2 trials, 4.30
    at 3) makes the interval as wide as so few trials demand. Vectorised: a [..., n] array gives
    arrays of shape [...]. Fewer than 2 values (or any value not positive and finite): nan."""
    x = np.asarray(values, dtype=float)
    n = x.shape[axis]
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(np.isfinite(x) & (x > 0), np.log(np.where(x > 0, x, 1.0)), np.nan)
        centre = logs.mean(axis=axis)
        if n < 2:
            nan = np.full_like(centre, np.nan)
            return np.exp(centre), nan, nan
        half = student_t.ppf(1 - alpha / 2, n - 1) * logs.std(axis=axis, ddof=1) / math.sqrt(n)
    return np.exp(centre), np.exp(centre - half), np.exp(centre + half)


def trial_interval(values: Sequence[float], alpha: float = 0.05) -> tuple[float, Interval]:
    """log_t_interval of one list of per-trial values -> (geometric mean, (lower, upper))."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v) and v > 0], dtype=float)
    if x.size == 0:
        return math.nan, _NAN_CI
    centre, lo, hi = log_t_interval(x, alpha)
    return float(centre), (float(lo), float(hi))


def finite_interval(interval: tuple[float, float]) -> list[float] | None:
    """An interval as the summary keeps it: [lower, upper], or None where either end is not finite."""
    lo, hi = interval
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return [float(lo), float(hi)]


def interval_method(n: int, paired: bool = False) -> str | None:
    """How an interval over n trials was computed, in words (summary and report)."""
    if n < 2:
        return None
    what = "per-trial paired ratios (config / baseline, same trial)" if paired else "per-trial rates"
    return f"Student t interval on the mean log of {n} {what}, {n - 1} degree{'s' if n > 2 else ''} of freedom"


def rate_block(rates: dict[int, float]) -> dict:
    """Per-trial rates (trial -> value): their median, and from 2 trials the geometric mean with its
    trial_interval."""
    values = [rates[t] for t in sorted(rates)]
    block: dict = {"median": float(np.median(values)) if values else None,
                   "ci95": None, "trials": values, "ci_method": None}
    if len(values) >= 2:
        block["geomean"], ci = trial_interval(values)
        block["ci95"] = finite_interval(ci)
        block["ci_method"] = interval_method(len(values))
    return block


def paired_ratios(rc: dict[int, float], rb: dict[int, float]) -> dict:
    """Config vs baseline from trials both ran: the median of the per-trial ratios, and a t interval
    on their logs (see log_t_interval). Without common trials: the ratio of the medians, no
    interval (unpaired trials carry the machine's drift into the ratio)."""
    empty = {"median": None, "ci95": None, "trials": [], "ci_method": None}
    if not rc or not rb:
        return empty
    common = sorted(set(rc) & set(rb))
    if not common:
        return {**empty, "median": float(np.median(list(rc.values())) / np.median(list(rb.values())))}
    ratios = [rc[t] / rb[t] for t in common]
    out = {**empty, "median": float(np.median(ratios)), "trials": ratios}
    if len(ratios) >= 2:
        out["geomean"], ci = trial_interval(ratios)
        out["ci95"] = finite_interval(ci)
        out["ci_method"] = interval_method(len(ratios), paired=True)
    return out


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """mean and the requested percentiles (keys 'mean', 'p50', ...); None where no data."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    out: dict[str, float | None] = {"mean": float(x.mean()) if x.size else None}
    for q in qs:
        out[f"p{q:g}"] = float(np.percentile(x, q)) if x.size else None
    return out
