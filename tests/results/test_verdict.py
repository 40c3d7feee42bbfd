"""The paired accuracy interval, its design effect, the detectable drop and the verdict they give.

Known answers come from an independent route (the restricted likelihood maximised numerically,
a brute-force power computation), never from the code under test.
"""

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import binom, norm

from moebench.results.paired_accuracy import (design_effect, detectable_drop, identical_bound, paired_difference,
                                              tango_interval, trial_check, trial_widening)
from moebench.results.verdict import decide, judge_accuracy


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


def test_detectable_drop_by_hand():
    """No discordance, one trial: V(d) = d (1 - d) / n, so d = k^2 / (n + k^2), k = z(.975) + z(.8);
    never below the margin; nothing detectable with fewer than 20 items."""
    k2 = (norm.ppf(0.975) + norm.ppf(0.8)) ** 2
    for n in (48, 200, 1319):
        assert float(detectable_drop(n, n, 0.0)) == pytest.approx(k2 / (n + k2), rel=1e-6)
    assert float(detectable_drop(1319, 1319, 0.0, 1.0, 0.01)) == 0.01  # the margin is the floor
    assert math.isnan(float(detectable_drop(19, 19, 0.0)))
    # the run's own noise and the trial component only make it larger
    assert float(detectable_drop(1000, 200, 0.1, 1.0)) > float(detectable_drop(1000, 200, 0.0, 1.0))
    assert trial_widening(3) == pytest.approx(math.exp(-1))  # chi2(2)/2 ~ Exp(1): E max(0, X - 1) = 1/e
    assert trial_widening(1) == 0


def test_trial_check_by_hand_and_a_shocked_trial():
    x = np.array([[1, 0, 0], [0, -1, 0], [0, 0, 0], [1, 1, 0]], dtype=float)
    totals = np.array([2.0, 0.0, 0.0])
    within = sum(((row - row.mean()) ** 2).sum() for row in x)
    check = trial_check(x)
    assert float(check["q"]) == pytest.approx(2 * ((totals - totals.mean()) ** 2).sum() / within)
    assert int(check["standout"]) == 0
    rng = np.random.default_rng(5)
    calm = (rng.random((400, 1319, 5)) < 0.9).astype(int) - (rng.random((400, 1319, 5)) < 0.9)
    assert 0.003 <= float(trial_check(calm)["flagged"].mean()) <= 0.03  # its 1% false alarms
    shocked = calm[:50].copy()
    shocked[:, :200, 3] = -1  # trial 3 loses 200 answers
    out = trial_check(shocked)
    assert out["flagged"].all() and (out["standout"] == 3).all()


def test_identical_certifies_a_bound_on_the_population():
    assert identical_bound(48) == pytest.approx(1 - 0.05 ** (1 / 48))
    assert 2.9 / 1319 < identical_bound(1319) < 3.0 / 1319


def _vb(points, lo, hi, identical=0.5, p=1.0, lost=0, won=0, flagged=False):
    return {"accuracy_difference": {"points": points, "ci95": [lo, hi], "items": 200, "pairs": 200,
                                    "trials": 1, "identical_pairs": identical, "discordance": 0.05,
                                    "design_effect": 1.0, "trial_check": {"flagged": flagged, "standout": 2}},
            "mcnemar_p": p, "discordant": {"baseline_only": lost, "config_only": won}}


def test_the_decision_table():
    judge = lambda vb, margin=1.0, exact=False: judge_accuracy(vb, margin, exact=exact)  # noqa: E731
    assert judge(_vb(-0.2, -0.8, 0.4))["verdict"] == "non-inferior"
    assert judge(_vb(-0.2, -1.5, 1.1))["verdict"] == "inconclusive"
    assert judge(_vb(-0.2, -1.5, 1.1), 2.0)["verdict"] == "non-inferior"
    assert judge(_vb(-3.0, -5.0, -1.0))["verdict"] == "regression"
    # a drop shown, but inside the margin: passes, with a warning, never a regression
    inside = judge(_vb(-0.53, -0.74, -0.38))
    assert inside["verdict"] == "non-inferior" and "within the 1-point margin" in inside["warning"]
    # trial 0's McNemar decides nothing any more
    assert judge(_vb(-0.03, -0.29, 0.22, p=0.013, lost=12, won=2))["verdict"] == "non-inferior"
    # trials that disagree: never non-inferior
    assert judge(_vb(-0.2, -0.8, 0.4, flagged=True))["verdict"] == "inconclusive"
    assert judge(_vb(-2.0, -0.9, -0.1, flagged=True))["verdict"] == "regression"
    same = _vb(0.0, -1.9, 1.9, identical=1.0)
    text = judge(same, exact=True)["statement"]
    assert judge(same, exact=True)["verdict"] == "identical" and "at most 1.5% of items like these" in text
    assert judge(same)["verdict"] == "inconclusive"  # approximate: no shortcut
    text = judge(_vb(-0.2, -0.8, 0.4))["statement"]
    assert "would have been called a regression in >= 80% of runs like this one" in text
    assert "80%" not in judge(_vb(-3.0, -5.0, -1.0))["statement"]


def test_the_decision_is_monotone_in_evidence():
    """Intervals narrowing around a harmless drop (0.5 points) move from inconclusive to
    non-inferior and never back; around a harmful one (3 points) they never pass."""
    half = np.geomspace(5.0, 0.05, 200) / 100
    for centre, allowed in ((-0.005, (3, 1)), (-0.03, (3, 2))):
        codes = decide(centre - half, centre + half, 0.01)
        assert set(codes.tolist()) <= set(allowed)
        changes = np.flatnonzero(np.diff(codes))
        assert len(changes) <= 1 and codes[-1] == allowed[-1]
