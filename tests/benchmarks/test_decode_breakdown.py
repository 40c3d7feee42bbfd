"""benchmarks/decode_breakdown.py end to end on a tiny checkpoint, in a process of its own (it wraps the
model's methods with its timers for the whole process): it runs against the engine as it is now, and
its per-part bytes are the weights as the engine holds them (int4 rows and their scales: about a seventh
of float32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moebench.kernels.cpu_moe import load_extension
from repo_paths import REPO
from tiny_models import make_tiny_int4_checkpoint


def _breakdown(model, out, *extra):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode_breakdown.py"), "--model", str(model),
                           "--threads", "1", "--batch", "1", "--new-tokens", "6", "--prompt-len", "8",
                           "--json", str(out), *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, json.loads(out.read_text())["threads=1 batch=1"]


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
