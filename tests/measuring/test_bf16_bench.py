"""bench-engine on a bfloat16 checkpoint: the runtime reads bfloat16 weights and says so, and both
engines' bytes per step count each one's own weights (a GGUF's tensors, transformers' float32)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from moebench.measuring.bench_engine import float32_weight_bytes, gguf_weight_bytes, step_weight_bytes
from moebench.cli.app import main
from moebench.engine import load_checkpoint
from moebench.models.export_gguf import export_gguf
from tiny_models import make_tiny_checkpoint, write_char_tokenizer


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from moebench.kernels.cpu_dense import dense_kernel_enabled

    if not dense_kernel_enabled():
        pytest.skip("the C++ extension is not available here: a bfloat16 checkpoint's dense weights are widened at load")
    return write_char_tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "tiny", dtype=torch.bfloat16), 211)


def _by_hand(cfg, element: int) -> tuple[int, int]:
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, k, v, o
    return element * (cfg.num_layers * attn + cfg.vocab_size * cfg.hidden_size), element * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def test_weight_bytes_of_each_engine(tiny_bf16, tmp_path):
    ckpt = load_checkpoint(tiny_bf16, experts_in_checkpoint_dtype=True)
    assert step_weight_bytes(ckpt) == _by_hand(ckpt.config, 2)  # the runtime holds bfloat16
    assert float32_weight_bytes(ckpt) == _by_hand(ckpt.config, 4)
    assert gguf_weight_bytes(export_gguf(tiny_bf16, tmp_path / "bf16.gguf", "bf16"), ckpt.config) == _by_hand(ckpt.config, 2)
    assert gguf_weight_bytes(export_gguf(tiny_bf16, tmp_path / "f32.gguf", "f32"), ckpt.config) == _by_hand(ckpt.config, 4)


def test_bench_engine_on_a_bf16_checkpoint(tiny_bf16, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["moebench", "bench-engine", "--model", str(tiny_bf16), "--batch", "1",
                                      "--threads", "1", "--threads", "2", "--new-tokens", "5", "--repeats", "1", "--prompt-len", "8",
                                      "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        main()
    stdout = capsys.readouterr().out
    assert exc.value.code in (0, None)
    assert "weights: moebench bf16, transformers f32" in " ".join(stdout.split())
    manifest = json.loads(out.read_text())
    assert manifest["dtype"] == "bf16" and manifest["dense_dtype"] == "bfloat16"
    assert manifest["runtime_evidence"]["prefetch"]["expert_dtype"] == "bfloat16"
    cfg = load_checkpoint(tiny_bf16).config
    (d2, e2), (d4, e4) = _by_hand(cfg, 2), _by_hand(cfg, 4)
    assert [row["threads"] for row in manifest["rows"]] == [1, 2]
    for row in manifest["rows"]:
        ours, theirs = (row["engines"][name]["bytes_per_step"] for name in ("moebench", "transformers"))
        # batch 1: a step reads top_k distinct experts per layer in both; the KV cache is float32 in both
        assert theirs - ours == pytest.approx((d4 - d2) + cfg.top_k * cfg.num_layers * (e4 - e2))
        assert row["engines"]["moebench"]["greedy_identical_to_transformers"] == 1


def test_dtype_that_is_not_the_checkpoints_is_refused(tiny_bf16, capsys, monkeypatch):
    for args, needle in ((["--dtype", "f32"], "not --dtype f32"), (["--dtype", "int4"], "--dtype"),
                         (["--gguf-dtype", "q4"], "--gguf-dtype")):
        monkeypatch.setattr(sys, "argv", ["moebench", "bench-engine", "--model", str(tiny_bf16), *args])
        with pytest.raises(SystemExit) as exc:
            main()
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
