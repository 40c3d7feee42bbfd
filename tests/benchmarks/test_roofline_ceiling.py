"""benchmarks/roofline_ceiling.py end to end on a tiny checkpoint: one round, in a process of its own. The
engine it scores runs with the --weights it is given, and the pure stream reads that engine's step bytes
(int4 rows and their scales: well under half of float32's). Its decode steps run on bench-engine's path,
native, unless told otherwise, as the run's own evidence says."""

from __future__ import annotations

import re

import pytest

from benchmark_scripts import run_benchmark
from moebench.kernels.cpu_moe import load_extension
from tiny_models import make_tiny_int4_checkpoint


def _ceiling(model, *extra) -> tuple[str, float]:
    text = run_benchmark("roofline_ceiling", "--model", str(model), "--threads", "1", "--rounds", "1",
                         "--prompt-len", "8", "--new-tokens", "6", *extra)
    step = re.search(r"([\d.]+) MB per decode step", text)
    assert step, text
    return text, float(step.group(1))


def test_the_stream_reads_the_step_bytes_of_the_engine_it_scores(tmp_path):
    if load_extension() is None:
        pytest.skip("the C++ extension is not available here")
    model = make_tiny_int4_checkpoint(tmp_path / "model")
    text, f32 = _ceiling(model)
    assert "pure stream" in text and "median over 1 rounds" in text
    assert "decode path native, steps {'native-layers': " in text, text
    text, int4 = _ceiling(model, "--weights", "int4")
    assert "(int4 weights, f32 LM head)" in text
    assert 0 < int4 < 0.5 * f32
    text, _ = _ceiling(model, "--decode-path", "chained")
    assert "decode path chained, steps {'layer-by-layer': " in text, text
