"""The paired accuracy interval, its design effect, the detectable drop and the verdict they give.

Known answers come from an independent route (the restricted likelihood maximised numerically,
a brute-force power computation), never from the code under test.
"""

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import binom, norm

from moebench.results.paired_accuracy import (design_effect, detectable_drop, paired_difference, planned_drop,
                                      tango_interval)
from moebench.results.verdict import judge_accuracy


def _score(delta, gain, loss, n):
    """Tango's statistic at delta, its nuisance share maximised numerically (not in closed form)."""
    lo, hi = max(0.0, -delta) + 1e-13, (1 - delta) / 2 - 1e-13

    def nll(q):
        return -(gain * math.log(q + delta) + loss * math.log(q) + (n - gain - loss) * math.log(1 - 2 * q - delta))
    q = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-14}).x
    return (gain - loss - n * delta) / math.sqrt(n * (2 * q + delta - delta * delta))


@pytest.mark.parametrize("gain, loss, n", [(5, 1, 100), (0, 2, 40), (13, 14, 1319), (3, 9, 48), (20, 2, 200)])
def test_the_interval_ends_are_where_the_score_statistic_reaches_z(gain, loss, n):
    lo, hi = (float(v) for v in tango_interval(gain, loss, n))
    z = norm.ppf(0.975)
    assert _score(lo, gain, loss, n) == pytest.approx(z, abs=1e-5)
    assert _score(hi, gain, loss, n) == pytest.approx(-z, abs=1e-5)
    assert lo < (gain - loss) / n < hi


def test_no_discordant_pair_still_gives_an_interval_of_the_right_width():
    """0 of n discordant: the ends solve n d / (1 - d) = z^2, i.e. d = z^2 / (n + z^2)
    (a bootstrap or a t interval would give [0, 0])."""
    z2 = norm.ppf(0.975) ** 2
    for n in (48, 200, 1319):
        lo, hi = tango_interval(0, 0, n)
        assert float(hi) == pytest.approx(z2 / (n + z2), rel=1e-6) and float(lo) == pytest.approx(-float(hi))
    lo, hi = tango_interval(0, 48, 48)  # every item lost: the lower end is the edge
    assert float(lo) == -1.0 and _score(float(hi), 0, 48, 48) == pytest.approx(-norm.ppf(0.975), abs=1e-5)


def test_repeated_greedy_trials_count_as_one_and_independent_ones_do_not():
    rng = np.random.default_rng(1)
    items = 200
    base = rng.random(items) < 0.9
    cfg = base.copy()
    cfg[:6] = ~cfg[:6]
    one = paired_difference(np.arange(items), base, cfg)
    rep = paired_difference(np.tile(np.arange(items), 5), np.tile(base, 5), np.tile(cfg, 5))
    assert rep["design_effect"] == 5.0 and rep["pairs"] == 5 * items
    assert (rep["lower"], rep["upper"]) == (pytest.approx(one["lower"]), pytest.approx(one["upper"]))
    # Five independent draws per item: discordance spread over trials, design effect near 1
    b = rng.random((items, 5)) < 0.9
    c = rng.random((items, 5)) < 0.9
    ind = paired_difference(np.repeat(np.arange(items), 5), b.ravel(), c.ravel())
    assert 1.0 <= ind["design_effect"] < 1.6
    assert ind["method"].startswith("Tango score interval on counts divided by the design effect")


def test_design_effect_from_item_totals():
    """By hand: 4 items x 2 trials, one item lost both trials, one lost once."""
    diff = np.array([-2.0, -1.0, 0.0, 0.0])
    pairs = np.full(4, 2.0)
    est = -3 / 8
    var_cluster = 4 / 3 * ((-2 - 2 * est) ** 2 + (-1 - 2 * est) ** 2 + 2 * (2 * est) ** 2) / 64
    var_pairs = (3 / 8 - est ** 2) / 8
    assert float(design_effect(diff, pairs, 0, 3)) == pytest.approx(min(2.0, max(1.0, var_cluster / var_pairs)))
    assert float(design_effect(np.zeros(4), pairs, 0, 0)) == 2.0  # nothing discordant: the cluster size


@pytest.mark.parametrize("n, psi, most", [(500, 0.2, 0.83), (1000, 0.18, 0.83), (1319, 0.02, 0.86),
                                           (200, 0.06, 0.88), (200, 0.0, 0.96), (48, 0.0, 0.96)])
def test_detectable_drop_has_the_power_it_claims(n, psi, most):
    """At the drop the formula gives, the power of the score test at 0 (the interval's upper end
    below 0), computed exactly over the binomial number of discordant pairs and the losses among
    them, is at least 80%: close to it with many discordant pairs, up to 95% where every
    discordant pair is a loss (Connor's normal approximation is conservative there)."""
    z = norm.ppf(0.975)
    d = float(detectable_drop(n, psi))
    psi = max(psi, d)
    power = 0.0
    for k in range(1, n + 1):
        pk = binom.pmf(k, n, psi)
        if pk < 1e-12:
            continue
        p_loss = (psi + d) / (2 * psi)
        lost = np.arange(k + 1)
        zstat = (2 * lost - k) / math.sqrt(k)
        power += pk * binom.pmf(lost, k, p_loss)[zstat > z].sum()
    assert 0.795 <= power <= most, (n, psi, d, power)


def test_planned_drop_bounds():
    plan = planned_drop(200, 0.9, trials=5)
    z = norm.ppf(0.975) + norm.ppf(0.8)
    assert plan["rare"] == pytest.approx(z * z / 200, rel=0.1)  # psi = d: d ~ z^2 / n
    assert planned_drop(200, 0.9, trials=1)["independent"] > plan["independent"]
    assert math.isnan(float(detectable_drop(3, 0.0)))  # 3 pairs cannot detect anything


def _vb(points, lo, hi, identical=0.5, p=1.0, lost=0, won=0, drop=2.0):
    return {"accuracy_difference": {"points": points, "ci95": [lo, hi], "items": 200, "pairs": 200,
                                    "trials": 1, "identical_pairs": identical, "detectable_drop": drop},
            "mcnemar_p": p, "discordant": {"baseline_only": lost, "config_only": won}}


def test_the_verdicts():
    assert judge_accuracy(_vb(-0.2, -0.8, 0.4), 1.0, exact=False)["verdict"] == "non-inferior"
    assert judge_accuracy(_vb(-0.2, -1.5, 1.1), 1.0, exact=False)["verdict"] == "inconclusive"
    assert judge_accuracy(_vb(-0.2, -1.5, 1.1), 2.0, exact=False)["verdict"] == "non-inferior"
    assert judge_accuracy(_vb(-3.0, -5.0, -1.0), 1.0, exact=False)["verdict"] == "regression"
    # McNemar against the config on trial 0 is a regression even where the interval reaches 0
    assert judge_accuracy(_vb(-1.0, -3.0, 0.1, p=0.01, lost=9, won=1), 1.0, exact=False)["verdict"] == "regression"
    assert judge_accuracy(_vb(1.0, -0.1, 3.0, p=0.01, lost=1, won=9), 1.0, exact=False)["verdict"] == "non-inferior"
    same = _vb(0.0, -1.9, 1.9, identical=1.0)
    assert judge_accuracy(same, 1.0, exact=True)["verdict"] == "identical"
    assert judge_accuracy(same, 1.0, exact=False)["verdict"] == "inconclusive"  # approximate: no shortcut
    text = judge_accuracy(_vb(-0.2, -0.8, 0.4, drop=2.1), 1.0, exact=False)["statement"]
    assert "a drop of 2.1 points or more would have been detected with 80% power; none was" in text
    assert "none was" not in judge_accuracy(_vb(-3.0, -5.0, -1.0), 1.0, exact=False)["statement"]


def test_coverage_by_simulation_at_a_run_size_used():
    """The benchmark's simulation (docs/statistics.md has the full grid): 200 items, accuracy 0.9,
    a true drop of 1 point. The score interval covers ~95%; treating greedy trials that repeat
    the same answers as independent pairs (what the design effect prevents) covers far less."""
    from benchmark_scripts import load_benchmark

    sim = load_benchmark("paired_accuracy_coverage")
    rng = np.random.default_rng(3)
    one = sim.cell(200, 1, 0.9, 0.01, "indep", 3000, rng)
    assert 0.93 <= one["score"] <= 0.97, one
    repeated = sim.cell(200, 3, 0.9, 0.01, "repeat", 3000, rng)
    assert 0.93 <= repeated["score"] <= 0.97 and repeated["pooled"] < 0.85, repeated
    sampled = sim.cell(200, 5, 0.9, 0.01, "shared", 3000, rng)
    assert 0.93 <= sampled["score"] <= 0.97, sampled
