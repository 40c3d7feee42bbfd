"""Statistics for the verdict: Wilson and bootstrap intervals, exact McNemar.

Every bootstrap uses numpy's Generator with a fixed seed so that a summary built twice from
the same results is identical. Intervals are percentile intervals (2.5%, 97.5%).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy.stats import binomtest
from statsmodels.stats.proportion import proportion_confint

DEFAULT_SEED = 0
DEFAULT_BOOT = 10_000
# Bounds the size of one index matrix (resamples x observations) so a large step table
# does not need gigabytes of memory.
_MAX_CELLS = 4_000_000

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


def _percentile_ci(samples: np.ndarray, alpha: float = 0.05) -> Interval:
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return _NAN_CI
    lo, hi = np.quantile(samples, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def _resample(n: int, stat: Callable[[np.ndarray], np.ndarray], n_boot: int,
              rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of stat, which maps an index matrix (k, n) to k values."""
    out = np.empty(n_boot)
    chunk = max(1, _MAX_CELLS // max(n, 1))
    for start in range(0, n_boot, chunk):
        k = min(chunk, n_boot - start)
        out[start:start + k] = stat(rng.integers(0, n, size=(k, n)))
    return out


def bootstrap_median_ci(values: Sequence[float], n_boot: int = DEFAULT_BOOT,
                        seed: int = DEFAULT_SEED) -> Interval:
    """Percentile bootstrap interval of the median."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return _NAN_CI
    if x.size == 1:
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    reps = _resample(x.size, lambda idx: np.median(x[idx], axis=1), n_boot, rng)
    return _percentile_ci(reps)


def bootstrap_ratio_of_medians_ci(num: Sequence[float], den: Sequence[float],
                                  paired: bool = True, n_boot: int = DEFAULT_BOOT,
                                  seed: int = DEFAULT_SEED) -> Interval:
    """Percentile bootstrap interval of median(num) / median(den) (a speedup).

    paired: num[t] and den[t] come from the same interleaved trial t, so both are resampled
    with the same indices; this keeps the machine-load drift that a trial shares out of the
    ratio's noise. Unpaired (or unequal lengths): each side is resampled on its own.
    """
    a = np.asarray(num, dtype=float)
    b = np.asarray(den, dtype=float)
    if a.size == 0 or b.size == 0:
        return _NAN_CI
    rng = np.random.default_rng(seed)
    if paired and a.size == b.size:
        reps = _resample(a.size, lambda idx: np.median(a[idx], axis=1) / np.median(b[idx], axis=1),
                         n_boot, rng)
    else:
        ra = _resample(a.size, lambda idx: np.median(a[idx], axis=1), n_boot, rng)
        rb = _resample(b.size, lambda idx: np.median(b[idx], axis=1), n_boot, rng)
        reps = ra / rb
    return _percentile_ci(reps)


def bootstrap_rate_replicates(tokens: Sequence[float], durations: Sequence[float],
                              n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED) -> np.ndarray:
    """Bootstrap replicates of sum(tokens) / sum(durations), resampling (tokens, duration) rows.

    Used for step-level throughput when there are too few trials to bootstrap over trials.
    """
    t = np.asarray(tokens, dtype=float)
    d = np.asarray(durations, dtype=float)
    if t.size == 0 or t.size != d.size:
        return np.full(0, math.nan)
    rng = np.random.default_rng(seed)
    return _resample(t.size, lambda idx: t[idx].sum(axis=1) / d[idx].sum(axis=1), n_boot, rng)


def bootstrap_rate_ci(tokens: Sequence[float], durations: Sequence[float],
                      n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED) -> Interval:
    """Percentile bootstrap interval of sum(tokens) / sum(durations) over resampled rows."""
    return _percentile_ci(bootstrap_rate_replicates(tokens, durations, n_boot, seed))


def paired_accuracy_diff_ci(base_correct: Sequence[bool], new_correct: Sequence[bool],
                            n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED) -> Interval:
    """Paired bootstrap interval of accuracy(new) - accuracy(base), as a fraction.

    Resampling items only matters through how many of each kind of pair is drawn (new-only
    correct, base-only correct, agreeing), so the bootstrap draws those counts from a
    multinomial: the same distribution as resampling items, without an item-index matrix.
    """
    a = np.asarray(base_correct, dtype=bool)
    b = np.asarray(new_correct, dtype=bool)
    if a.size == 0 or a.size != b.size:
        return _NAN_CI
    n = a.size
    gain = int(np.sum(b & ~a))
    loss = int(np.sum(a & ~b))
    p = np.array([gain, loss, n - gain - loss], dtype=float) / n
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, p, size=n_boot)
    return _percentile_ci((counts[:, 0] - counts[:, 1]) / n)


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """mean and the requested percentiles (keys 'mean', 'p50', ...); None where no data."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    out: dict[str, float | None] = {"mean": float(x.mean()) if x.size else None}
    for q in qs:
        out[f"p{q:g}"] = float(np.percentile(x, q)) if x.size else None
    return out
