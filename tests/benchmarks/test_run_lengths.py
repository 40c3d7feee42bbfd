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


def test_a_runs_evidence_says_the_run_length_its_kernels_used():
    ext = load_extension()
    if ext is None:
        pytest.skip("the C++ extension is not available here")
    from moebench.engine import Engine, Request, RuntimeConfig
    from moebench.measuring.bench_models import benchmark_checkpoint

    ckpt = benchmark_checkpoint("bundled", None)
    rt = RuntimeConfig(kernel="fused", decode_path="native", batch_size=1, max_new_tokens=4)
    before = ext.stream_run_bytes()
    seen = {}
    try:
        for run_bytes in (0, 256 * 1024):
            ext.set_stream_run_bytes(run_bytes)
            result = Engine(ckpt, None, rt).generate([Request("r", "", 4)], prompt_ids=[[5, 6, 7]])
            seen[run_bytes] = result.evidence["decode_path"]["streamed_dots"]
    finally:
        ext.set_stream_run_bytes(before)
    for run_bytes, dots in seen.items():
        assert dots["stream_run_bytes"] == run_bytes
        assert dots["avx2_rows"] + dots["avx512_rows"] > 0  # the streamed dots ran under it
