"""bench_prefetch's summary arithmetic: ratios of paired repeats."""

import math

from benchmark_scripts import load_benchmark

_summarise = load_benchmark("bench_prefetch")._summarise


def test_hidden_share_leaves_out_pairs_without_a_penalty():
    names = ["resident", "resident/lookahead", "host/off", "host/lookahead"]
    times = {"resident": [1.0, 1.0, 1.0], "resident/lookahead": [1.0, 1.0, 1.0],
             "host/off": [2.0, 0.9, 3.0],  # the second pair: off no slower than resident
             "host/lookahead": [1.5, 1.0, 1.5]}
    zeros = {n: [0.0, 0.0, 0.0] for n in names}
    out = _summarise(1, names, ["host"], times, zeros, zeros, {n: {} for n in names})
    tier = out["tiers"]["host"]
    assert math.isnan(tier["hidden_share_trials"][1])
    assert tier["hidden_share"] == 0.625  # median of 0.5 and 0.75, the nan pair left out
    assert tier["speedup_vs_off"] == 4 / 3  # median of 2/1.5, 0.9/1.0, 3/1.5
