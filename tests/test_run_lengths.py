"""benchmarks/run_lengths.py on the bundled model: it alternates the byte-sized items with the fixed
ones in one process, finds the logits the same bit for bit, and leaves the run length as it found it."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import load_benchmark
from moebench.kernels.cpu_moe import load_extension


def test_run_lengths_alternates_both_sizes_with_equal_logits(monkeypatch, capsys):
    ext = load_extension()
    if ext is None:
        pytest.skip("the C++ extension is not available here")
    before = ext.stream_run_bytes()
    monkeypatch.setattr(sys, "argv", ["run_lengths.py", "--model", "bundled", "--rounds", "2", "--forwards", "1"])
    load_benchmark("run_lengths").main()
    out = capsys.readouterr().out
    assert "logits differed in 0 of 2 rounds" in out
    assert "fixed / 128 KB" in out and "experts:" in out
    assert ext.stream_run_bytes() == before
