"""benchmarks/q8_kernel_rates.py: it times the q8 kernels themselves (the extension's q8 counters move,
or it stops with an error), restores the activations setting it found, and sets the batch-16 step's
integer dots beside the step time 50% of a bench-engine run's roofline allows, from that run's JSON, and
(--from-memory) one token's rate from memory beside read_in_runs'."""

from __future__ import annotations

import json
import re
import sys

import pytest

from benchmark_scripts import load_benchmark
from moebench.kernels.cpu_moe import load_extension
from repo_paths import REPO

RUN = REPO / "docs" / "measurements" / "bench-engine-int8-q8-rotated-runs-vs-llamacpp-q8_0-avx2-quiet.json"


def test_rates_and_the_batch_16_budget_of_a_run(monkeypatch, capsys):
    ext = load_extension()
    if ext is None or not hasattr(ext, "set_activations"):
        pytest.skip("the C++ extension is not available here")
    before = ext.simd_stats()["q8_weight_rows"]
    found = ext.activations()
    monkeypatch.setattr(sys, "argv", ["q8_kernel_rates.py", "--threads", "1", "--tokens", "3", "--repeats", "1",
                                      "--bench-json", str(RUN), "--from-memory"])
    load_benchmark("q8_kernel_rates").main()
    out = capsys.readouterr().out
    assert ext.simd_stats()["q8_weight_rows"] > before
    assert ext.activations() == found
    for weights in ("int4", "int8"):
        for k in (1024, 256):
            assert re.search(rf"{weights} x q8, K={k}: ns per block and token \(wall\): 3 tok \d+\.\d{{3}}", out)
    assert "52.0 M block-token dots per step (experts 25.2, projections 10.5, LM head 16.4)" in out
    row = next(r for r in json.loads(RUN.read_text())["rows"] if r["threads"] == 1 and r["batch"] == 16)
    allowed = row["bytes_per_step"] / (row["bandwidth_gb_s"] * 1e9) / 0.5 * 1e3
    # the run's --weights is int8: only the int8 line carries its budget
    assert "int8 weights, int8 head: the integer dots alone take >= " in out
    assert re.search(rf"int8 weights, .* allows {allowed:.1f} ms for the whole step", out)
    assert not re.search(r"int4 weights, .* allows", out)
    # one token from memory beside a pure stream over as many bytes, each weight format
    for weights in ("int4", "int8"):
        assert re.search(rf"1 thread\(s\), {weights} x q8, one token from memory: \d+\.\d GB/s of weights; "
                         r"read_in_runs \d+\.\d GB/s \(\d+%\)", out)
