"""Worked examples for moebench.results.stats, checked against values computed by hand."""

import math

import numpy as np
import pytest

from moebench.results import stats

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


def test_log_t_interval_worked_example():
    # logs 0 and ln 4: mean ln 2, sd ln 4 / sqrt 2, t(0.975, 1) = 12.706
    centre, lo, hi = stats.log_t_interval([1.0, 4.0])
    half = 12.706204736174698 * (math.log(4) / math.sqrt(2)) / math.sqrt(2)
    assert centre == pytest.approx(2.0)
    assert (lo, hi) == pytest.approx((2 * math.exp(-half), 2 * math.exp(half)))
    assert stats.trial_interval([7.0])[1] != stats.trial_interval([7.0])[1]  # nan: one trial has no interval
    assert stats.trial_interval([3.0, 3.0, 3.0]) == (pytest.approx(3.0), pytest.approx((3.0, 3.0)))
    assert all(math.isnan(v) for v in stats.trial_interval([])[1])


def test_pairing_cancels_shared_drift():
    base = np.array([100.0, 130.0, 80.0, 115.0, 90.0])  # trial-to-trial machine drift
    new = 2 * base * np.array([1.0, 1.01, 0.99, 1.0, 1.005])
    _, (lo, hi) = stats.trial_interval(new / base)
    assert 1.97 < lo <= 2.0 <= hi < 2.03
    _, (blo, bhi) = stats.trial_interval(base)
    assert bhi / blo > 1.3  # the rates themselves carry the drift


def _coverage(log_ratios: np.ndarray, truth: float) -> float:
    _, lo, hi = stats.log_t_interval(np.exp(log_ratios))
    return float(np.mean((lo <= truth) & (truth <= hi)))


@pytest.mark.parametrize("n", [2, 3, 5, 10])
def test_interval_has_nominal_coverage(n):
    """20,000 simulated runs of n trials: a config 1.5x the baseline, each trial's shared load drift
    (sd 30%) on both configs, and per-config noise (sd 3%). The paired interval must cover 1.5 in
    95% of runs for every n (the old min..max of 3 trials covered the median only 75% of the time)."""
    rng = np.random.default_rng(n)
    runs = 20_000
    drift = rng.normal(0, 0.3, (runs, n))
    log_base = np.log(100) + drift + rng.normal(0, 0.03, (runs, n))
    log_new = np.log(150) + drift + rng.normal(0, 0.03, (runs, n))
    assert 0.94 <= _coverage(log_new - log_base, 1.5) <= 0.96


def test_rotating_the_order_keeps_coverage_where_a_fixed_order_loses_it():
    """A config running first in its trial is 4% slower (cold caches, a load spike that the second
    misses). With the baseline always first, every ratio carries that bias and the interval misses;
    with the order rotated between trials it averages out (and widens the interval honestly)."""
    rng = np.random.default_rng(7)
    runs, n, penalty = 20_000, 6, np.log(1.04)
    noise = rng.normal(0, 0.02, (runs, n))
    baseline_first = np.arange(n) % 2 == 0
    fixed = np.log(1.5) + noise + penalty  # the baseline, first every time, is the slow one
    rotated = np.log(1.5) + noise + np.where(baseline_first, penalty, -penalty)
    assert _coverage(fixed, 1.5) < 0.5
    assert _coverage(rotated, 1.5) >= 0.94


def test_percentiles():
    out = stats.percentiles(list(range(1, 101)))
    assert out["mean"] == 50.5 and out["p50"] == 50.5
    assert out["p95"] == pytest.approx(95.05)
    assert stats.percentiles([]) == {"mean": None, "p50": None, "p95": None, "p99": None}
