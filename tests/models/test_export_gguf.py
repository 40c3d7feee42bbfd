"""`moebench export gguf`: every tensor read back from the GGUF equals the checkpoint's own
(safetensors, read independently of the exporter), the llama.cpp metadata and tokenizer are what
llama.cpp needs, and unsupported checkpoints are refused with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file

from moebench.errors import MoebenchError
from moebench.models.export_gguf import _gpt2_byte_alphabet, export_gguf
from moebench.measuring.run import bundled_model_path
from tiny_models import make_tiny_checkpoint, write_char_tokenizer

BUNDLED = bundled_model_path()


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def _tensors(reader: GGUFReader) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in reader.tensors}


def _expected_tensors(model_dir: Path, cfg: dict, rope_interleave: bool) -> dict[str, torch.Tensor]:
    """The GGUF tensors as they should be, built straight from the safetensors file."""
    st = load_file(str(model_dir / "model.safetensors"))
    st = {k: v.float() for k, v in st.items()}
    E = cfg.get("num_experts", cfg.get("num_local_experts"))
    moe = "block_sparse_moe" if cfg["model_type"] == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if cfg["model_type"] == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
        # independent of the exporter: row r of head h, half s, index i goes to row 2*i + s
        hd = w.shape[0] // heads
        out = torch.empty_like(w)
        for h in range(heads):
            for i in range(hd // 2):
                out[h * hd + 2 * i] = w[h * hd + i]
                out[h * hd + 2 * i + 1] = w[h * hd + hd // 2 + i]
        return out

    expected = {"token_embd.weight": st["model.embed_tokens.weight"], "output_norm.weight": st["model.norm.weight"]}
    if "lm_head.weight" in st:
        expected["output.weight"] = st["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}", f"blk.{i}"
        q, k = st[f"{p}.self_attn.q_proj.weight"], st[f"{p}.self_attn.k_proj.weight"]
        if rope_interleave:
            q, k = interleave(q, cfg["num_attention_heads"]), interleave(k, cfg["num_key_value_heads"])
        expected.update({
            f"{b}.attn_norm.weight": st[f"{p}.input_layernorm.weight"],
            f"{b}.attn_q.weight": q, f"{b}.attn_k.weight": k,
            f"{b}.attn_v.weight": st[f"{p}.self_attn.v_proj.weight"],
            f"{b}.attn_output.weight": st[f"{p}.self_attn.o_proj.weight"],
            f"{b}.ffn_norm.weight": st[f"{p}.post_attention_layernorm.weight"],
            f"{b}.ffn_gate_inp.weight": st[f"{p}.{moe}.gate.weight"],
        })
        if f"{p}.self_attn.q_norm.weight" in st:
            expected[f"{b}.attn_q_norm.weight"] = st[f"{p}.self_attn.q_norm.weight"]
            expected[f"{b}.attn_k_norm.weight"] = st[f"{p}.self_attn.k_norm.weight"]
        for gguf_name, hf_name in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
            expected[f"{b}.{gguf_name}.weight"] = torch.stack(
                [st[f"{p}.{moe}.experts.{e}.{hf_name}.weight"] for e in range(E)])
    return expected


@pytest.fixture(scope="module")
def bundled_f32(tmp_path_factory) -> Path:
    return export_gguf(BUNDLED, tmp_path_factory.mktemp("gguf") / "bundled.gguf")


def test_bundled_f32_tensors_round_trip_exactly(bundled_f32):
    cfg = json.loads((BUNDLED / "config.json").read_text())
    reader = GGUFReader(str(bundled_f32))
    got = _tensors(reader)
    expected = _expected_tensors(BUNDLED, cfg, rope_interleave=False)
    assert set(got) == set(expected)  # tied embeddings: no output.weight, llama.cpp reuses token_embd
    for name, want in expected.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == tuple(want.shape), name
        assert np.array_equal(got[name], want.numpy()), name  # bfloat16 -> float32 is exact


def test_bundled_metadata_and_tokenizer(bundled_f32):
    cfg = json.loads((BUNDLED / "config.json").read_text())
    tok = json.loads((BUNDLED / "tokenizer.json").read_text())
    r = GGUFReader(str(bundled_f32))
    assert _field(r, "general.architecture") == "qwen3moe"
    assert _field(r, "general.file_type") == 0  # all F32
    for key, want in (("block_count", cfg["num_hidden_layers"]), ("embedding_length", cfg["hidden_size"]),
                      ("expert_count", cfg["num_local_experts"]), ("expert_used_count", cfg["num_experts_per_tok"]),
                      ("expert_feed_forward_length", cfg["moe_intermediate_size"]),
                      ("attention.head_count", cfg["num_attention_heads"]),
                      ("attention.head_count_kv", cfg["num_key_value_heads"]),
                      ("attention.key_length", cfg["head_dim"]), ("context_length", cfg["max_position_embeddings"])):
        assert _field(r, f"qwen3moe.{key}") == want, key
    assert _field(r, "qwen3moe.rope.freq_base") == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert _field(r, "qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "command-r"  # \p{N} split, then the GPT-2 regex
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"]
    assert {text: i for i, text in enumerate(tokens)} == tok["model"]["vocab"]
    merges = _field(r, "tokenizer.ggml.merges")
    assert merges == [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    types = _field(r, "tokenizer.ggml.token_type")
    assert [types[i] for i in (0, 1, 2)] == [3, 3, 3] and set(types[3:]) == {1}  # control specials, normal rest
    assert (_field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id"),
            _field(r, "tokenizer.ggml.padding_token_id")) == (1, 2, 0)
    assert _field(r, "tokenizer.ggml.add_bos_token") is False


def test_f16_weights_with_f32_norms_and_router(tmp_path):
    out = export_gguf(BUNDLED, tmp_path / "b16.gguf", "f16")
    cfg = json.loads((BUNDLED / "config.json").read_text())
    r = GGUFReader(str(out))
    assert _field(r, "general.file_type") == 1
    got = _tensors(r)
    for name, want in _expected_tensors(BUNDLED, cfg, rope_interleave=False).items():
        keep_f32 = want.dim() == 1 or "ffn_gate_inp" in name
        assert got[name].dtype == (np.float32 if keep_f32 else np.float16), name
        assert np.array_equal(got[name], want.to(torch.float32 if keep_f32 else torch.float16).numpy()), name


def test_bf16_weights_hold_the_bf16_checkpoint_exactly(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    out = export_gguf(BUNDLED, tmp_path / "bf16.gguf", "bf16")  # the bundled checkpoint is bfloat16
    cfg = json.loads((BUNDLED / "config.json").read_text())
    r = GGUFReader(str(out))
    assert _field(r, "general.file_type") == 32  # llama.cpp's MOSTLY_BF16
    tensors = {t.name: t for t in r.tensors}
    expected = _expected_tensors(BUNDLED, cfg, rope_interleave=False)
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        keep_f32 = want.dim() == 1 or "ffn_gate_inp" in name
        t = tensors[name]
        assert t.tensor_type == (Q.F32 if keep_f32 else Q.BF16), name
        got = dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
        assert np.array_equal(got, want.numpy()), name  # bfloat16 values, bit for bit


def test_q8_0_weights_are_blocks_of_32_within_half_a_step(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    out = export_gguf(BUNDLED, tmp_path / "q8.gguf", "q8_0")
    cfg = json.loads((BUNDLED / "config.json").read_text())
    r = GGUFReader(str(out))
    assert _field(r, "general.file_type") == 7  # llama.cpp's MOSTLY_Q8_0
    tensors = {t.name: t for t in r.tensors}
    for name, want in _expected_tensors(BUNDLED, cfg, rope_interleave=False).items():
        keep_f32 = want.dim() == 1 or "ffn_gate_inp" in name
        t = tensors[name]
        assert t.tensor_type == (Q.F32 if keep_f32 else Q.Q8_0), name
        got = torch.from_numpy(dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape).copy())
        if keep_f32:
            assert torch.equal(got, want), name
            continue
        # each run of 32 values shares one scale d = amax / 127, stored as float16: every value within
        # half a step plus up to 127 times the scale's rounding (2^-11 of it) of where it was
        blocks, got_blocks = want.reshape(-1, 32), got.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127
        assert ((got_blocks - blocks).abs() <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7).all(), name
        assert not torch.equal(got, want), name  # quantized, not copied


def test_q8_0_refuses_rows_not_in_blocks_of_32(tmp_path):
    ckpt = write_char_tokenizer(make_tiny_checkpoint(tmp_path / "mx", "mixtral_e5_k2"), 211)  # hidden 40
    with pytest.raises(MoebenchError, match="multiple of 32"):
        export_gguf(ckpt, tmp_path / "mx.gguf", "q8_0")
    assert not list(tmp_path.glob("*.gguf"))


def test_mixtral_untied_with_char_tokenizer(tmp_path):
    ckpt = write_char_tokenizer(make_tiny_checkpoint(tmp_path / "mx", "mixtral_e5_k2"), 211)
    cfg = json.loads((ckpt / "config.json").read_text())
    out = export_gguf(ckpt, tmp_path / "mx.gguf")
    r = GGUFReader(str(out))
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "llama.expert_count") == 5 and _field(r, "llama.feed_forward_length") == cfg["intermediate_size"]
    got = _tensors(r)
    expected = _expected_tensors(ckpt, cfg, rope_interleave=True)
    assert set(got) == set(expected) and "output.weight" in got
    for name, want in expected.items():
        assert np.array_equal(got[name], want.numpy()), name
    tokens = _field(r, "tokenizer.ggml.tokens")
    alphabet = _gpt2_byte_alphabet()
    assert tokens[2] == alphabet[ord(" ")] == "Ġ" and tokens[3] == "!"  # spelled in the byte-level alphabet
    assert _field(r, "tokenizer.ggml.eos_token_id") == 1


def test_unsupported_checkpoints_are_one_line_errors(tmp_path):
    no_norm = make_tiny_checkpoint(tmp_path / "q", "qwen3_e5_k1")  # norm_topk_prob=False
    write_char_tokenizer(no_norm, 211)
    with pytest.raises(MoebenchError, match="norm_topk_prob=false"):
        export_gguf(no_norm, tmp_path / "q.gguf")
    no_tokenizer = make_tiny_checkpoint(tmp_path / "n", "qwen3_e6_k2_norm")
    with pytest.raises(MoebenchError, match="tokenizer.json: no such file"):
        export_gguf(no_tokenizer, tmp_path / "n.gguf")
    words = make_tiny_checkpoint(tmp_path / "w", "qwen3_e6_k2_norm")
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()  # llama.cpp has no word-level tokenizer
    word_level.save(str(words / "tokenizer.json"))
    with pytest.raises(MoebenchError, match="splits text into single characters"):
        export_gguf(words, tmp_path / "w.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))


def test_cli_exit_2_on_bad_input(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moebench", "export", "gguf", "--model", str(tmp_path / "none"),
                             "--out", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "none: not a directory" in lines[0]
    result = subprocess.run([sys.executable, "-m", "moebench", "export", "gguf", "--model", str(BUNDLED),
                             "--out", str(tmp_path / "x.gguf"), "--dtype", "q4"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown weight type 'q4'" in result.stderr
