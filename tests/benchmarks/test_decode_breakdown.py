"""benchmarks/decode_breakdown.py end to end on a tiny checkpoint, in a process of its own (it wraps the
model's methods with its timers for the whole process): it runs against the engine as it is now, and
its per-part bytes are the weights as the engine holds them (int4 rows and their scales: about a seventh
of float32)."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import run_benchmark
from moebench.kernels.cpu_moe import load_extension
from tiny_models import make_tiny_int4_checkpoint


def _breakdown(model, out, *extra, threads: int = 1):
    text = run_benchmark("decode_breakdown", "--model", str(model), "--threads", str(threads), "--batch", "1",
                         "--new-tokens", "6", "--prompt-len", "8", "--json", str(out), *extra)
    return text, json.loads(out.read_text())[f"threads={threads} batch=1"]


def test_the_native_steps_parts_and_their_bytes_as_held(tmp_path):
    if load_extension() is None:
        pytest.skip("the C++ extension is not available here")
    model = make_tiny_int4_checkpoint(tmp_path / "model")
    text, f32 = _breakdown(model, tmp_path / "f32.json")
    assert "layers: experts" in f32["parts_ms"] and "layers: qkv projection" in f32["parts_ms"]
    assert f32["step_ms"] > 0 and "GB/s" in text
    _, int4 = _breakdown(model, tmp_path / "int4.json", "--weights", "int4")
    # the engine's own count of a step's bytes: int4 rows and their scales, not the checkpoint's floats
    assert int4["bytes_per_step"] < 0.5 * f32["bytes_per_step"]


def test_two_threads_report_the_callers_waits_at_section_ends(tmp_path):
    """With the step's thread pool, the time the calling thread spent at section ends waiting for a
    worker's last item, per step: printed beside the pool's other counts and kept in the JSON, apart from
    the parts (it is inside their time, not a part of its own)."""
    if load_extension() is None:
        pytest.skip("the C++ extension is not available here")
    model = make_tiny_int4_checkpoint(tmp_path / "model")
    text, two = _breakdown(model, tmp_path / "two.json", threads=2)
    assert "thread pool over the decode steps" in text and "section ends: the calling thread waited" in text
    assert two["caller_wait_ms_per_step"] >= 0
    assert not any("section ends" in name for name in two["parts_ms"])
