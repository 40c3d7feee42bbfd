"""benchmarks/decode_breakdown.py end to end on a tiny checkpoint, in a process of its own (it wraps the
model's methods with its timers for the whole process): it runs against the engine as it is now, and
its per-part bytes are the weights as the engine holds them (int4 rows are about a quarter of bf16's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moebench.kernels.cpu_moe import load_extension
from repo_paths import REPO


def _tiny_int4_ready(folder):
    """A Qwen3-MoE whose every matrix's rows are whole int4 groups (multiples of 32 wide)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                            num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.15,
                            max_position_embeddings=512, eos_token_id=None, pad_token_id=None, bos_token_id=None,
                            tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).eval().save_pretrained(folder)
    return folder


def _breakdown(model, out, *extra):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode_breakdown.py"), "--model", str(model),
                           "--threads", "1", "--batch", "1", "--new-tokens", "6", "--prompt-len", "8",
                           "--json", str(out), *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, json.loads(out.read_text())["threads=1 batch=1"]


def test_the_native_steps_parts_and_their_bytes_as_held(tmp_path):
    if load_extension() is None:
        pytest.skip("the C++ extension is not available here")
    model = _tiny_int4_ready(tmp_path / "model")
    text, f32 = _breakdown(model, tmp_path / "f32.json")
    assert "layers: experts" in f32["parts_ms"] and "layers: qkv projection" in f32["parts_ms"]
    assert f32["step_ms"] > 0 and "GB/s" in text
    _, int4 = _breakdown(model, tmp_path / "int4.json", "--weights", "int4")
    # the engine's own count of a step's bytes: int4 rows and their scales, not the checkpoint's floats
    assert int4["bytes_per_step"] < 0.5 * f32["bytes_per_step"]
