"""Worked examples for moebench.stats, checked against values computed by hand."""

import math

import numpy as np
import pytest

from moebench import stats

Z = 1.959963984540054  # the 97.5% normal quantile


def wilson_by_hand(k, n):
    p = k / n
    denom = 1 + Z**2 / n
    centre = (p + Z**2 / (2 * n)) / denom
    half = Z * math.sqrt(p * (1 - p) / n + Z**2 / (4 * n * n)) / denom
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(1278, 1319), (1277, 1319), (36, 40), (5, 10), (0, 10), (10, 10)])
def test_wilson_matches_formula(k, n):
    lo, hi = stats.wilson_ci(k, n)
    elo, ehi = wilson_by_hand(k, n)
    assert lo == pytest.approx(elo, abs=1e-9)
    assert hi == pytest.approx(ehi, abs=1e-9)


def test_wilson_reference_value_and_empty():
    lo, hi = stats.wilson_ci(1278, 1319)  # 96.89% in the reference run
    assert (round(lo, 4), round(hi, 4)) == (0.9581, 0.9770)
    assert all(math.isnan(v) for v in stats.wilson_ci(0, 0))


@pytest.mark.parametrize("b,c,p", [
    (14, 13, 1.0),                 # the reference run: 1264 / 14 / 13 / 28
    (13, 14, 1.0),
    (0, 0, 1.0),                   # no discordant pairs
    (0, 5, 2 * 1 / 32),            # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    (5, 0, 2 * 1 / 32),
    (1, 9, 2 * (1 + 10) / 1024),   # 2 * (C(10,0) + C(10,1)) / 2^10
    (2, 8, 2 * (1 + 10 + 45) / 1024),
    (3, 3, 1.0),
    (0, 20, 2 / 2**20),
    (4, 16, 2 * (1 + 20 + 190 + 1140 + 4845) / 2**20),
])
def test_mcnemar_exact_worked_examples(b, c, p):
    assert stats.mcnemar_exact(b, c) == pytest.approx(p, rel=1e-9)


def test_bootstrap_median_reproducible_and_sane():
    x = [100.0, 101.5, 99.2, 100.7, 98.9, 102.3, 100.1]
    a = stats.bootstrap_median_ci(x, seed=3)
    assert a == stats.bootstrap_median_ci(x, seed=3)
    assert a[0] <= np.median(x) <= a[1]
    assert min(x) <= a[0] and a[1] <= max(x)
    assert stats.bootstrap_median_ci([5.0, 5.0, 5.0]) == (5.0, 5.0)
    assert stats.bootstrap_median_ci([7.0]) == (7.0, 7.0)
    assert all(math.isnan(v) for v in stats.bootstrap_median_ci([]))


def test_ratio_of_medians_pairing_cancels_shared_drift():
    base = np.array([100.0, 130.0, 80.0, 115.0, 90.0])  # trial-to-trial machine drift
    new = 2 * base * np.array([1.0, 1.01, 0.99, 1.0, 1.005])
    lo, hi = stats.bootstrap_ratio_of_medians_ci(new, base, paired=True)
    assert 1.95 < lo <= 2.0 <= hi < 2.05
    ulo, uhi = stats.bootstrap_ratio_of_medians_ci(new, base, paired=False)
    assert uhi - ulo > 5 * (hi - lo)
    assert stats.bootstrap_ratio_of_medians_ci(2 * base, base) == pytest.approx((2.0, 2.0))


def test_rate_ci_brackets_the_rate():
    rng = np.random.default_rng(1)
    tok = np.full(200, 8.0)
    dur = 8 / 100 * (1 + 0.05 * rng.standard_normal(200))
    lo, hi = stats.bootstrap_rate_ci(tok, dur, n_boot=1000)
    assert lo < tok.sum() / dur.sum() < hi
    assert 97 < lo and hi < 103


def test_paired_accuracy_diff_matches_item_resampling():
    n = 200
    base = np.ones(n, bool)
    base[:20] = False
    new = base.copy()
    new[:12] = True       # 12 gained
    new[100:104] = False  # 4 lost
    lo, hi = stats.paired_accuracy_diff_ci(base, new, n_boot=20_000, seed=0)
    # The same bootstrap done the slow way, resampling items.
    rng = np.random.default_rng(5)
    idx = rng.integers(0, n, size=(20_000, n))
    reps = new[idx].mean(1) - base[idx].mean(1)
    elo, ehi = np.quantile(reps, [0.025, 0.975])
    assert lo == pytest.approx(elo, abs=0.006)
    assert hi == pytest.approx(ehi, abs=0.006)
    assert lo < 8 / n < hi
    assert stats.paired_accuracy_diff_ci(base, base) == (0.0, 0.0)


def test_percentiles():
    out = stats.percentiles(list(range(1, 101)))
    assert out["mean"] == 50.5 and out["p50"] == 50.5
    assert out["p95"] == pytest.approx(95.05)
    assert stats.percentiles([]) == {"mean": None, "p50": None, "p95": None, "p99": None}
