"""The verdict's key claims, kept by simulation (seeded, vectorised; the full grid and its figures:
benchmarks/paired_accuracy_coverage.py and docs/statistics.md). Each cell runs moebench's own
interval, trial check, detectable drop and decision table on simulated runs in the answer models
the benchmark defines (same-seed or diverged answers, drops in whole items or spread, trial shocks)."""

import numpy as np
import pytest

from benchmark_scripts import load_benchmark

sim = load_benchmark("paired_accuracy_coverage")
RUNS = 800
SLACK = 0.02  # about 1.5 standard errors of a rate near 0.9 over RUNS runs


def cell(model, items, trials, acc, drop, seed, runs=RUNS):
    return sim.cell(model, items, trials, acc, drop, runs, np.random.default_rng(seed))


@pytest.mark.parametrize("model, items, trials, acc", [("same-spread", 200, 3, 0.9), ("diverged-items", 200, 3, 0.9),
                                                       ("greedy", 1319, 5, 0.99), ("diverged-spread", 48, 1, 0.6)])
def test_coverage_and_no_false_regressions(model, items, trials, acc):
    assert cell(model, items, trials, acc, 0.01, 1)["coverage"] >= 0.93 - SLACK
    assert cell(model, items, trials, acc, 0.0, 2)["regression"] <= 0.05 + SLACK


@pytest.mark.parametrize("model", ["same-spread", "diverged-spread"])
def test_a_drop_of_the_margin_is_seldom_called_non_inferior(model):
    assert cell(model, 1319, 5, 0.9, 0.01, 3)["non-inferior"] <= 0.025 + SLACK


@pytest.mark.parametrize("model, items, trials, acc", [("same-items", 200, 1, 0.9), ("diverged-items", 1319, 3, 0.9),
                                                       ("same-spread", 1319, 1, 0.6)])
def test_the_printed_detectable_drop_is_caught(model, items, trials, acc):
    printed = cell(model, items, trials, acc, 0.0, 4)["detectable_points"]
    assert cell(model, items, trials, acc, printed / 100, 5)["regression"] >= 0.80 - SLACK


def test_a_strong_trial_shock_is_flagged_and_never_passes():
    shocked = cell("shock-strong", 1319, 5, 0.9, 0.0, 6, runs=300)
    assert shocked["flagged"] >= 0.9 and shocked["non-inferior"] == 0


def test_the_gate_is_monotone_over_items():
    """Fail = anything but non-inferior. For a harmless 0.5-point drop it never rises with more
    items; for a harmful 3-point drop it never falls."""
    for drop, sign in ((0.005, -1), (0.03, 1)):
        fails = [cell("diverged-spread", n, 1, 0.9, drop, 7 + n)["fail"] for n in (48, 200, 1319, 4000)]
        assert all(sign * (b - a) >= -SLACK for a, b in zip(fails, fails[1:])), (drop, fails)


def test_plan_items_give_the_assurance_they_promise():
    for row in sim.plan_check(1500, np.random.default_rng(8), echo=lambda _: None):
        assert 0.75 <= row["non_inferior"] <= 0.90, row
