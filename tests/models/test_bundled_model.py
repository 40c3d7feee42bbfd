"""The bundled gsm-synth MoE: loads in transformers and solves the synthetic suite."""

import json

import pytest
import torch
from safetensors import safe_open

from moebench.models.train import BUNDLED_DIR, EOS_ID, PAD_ID, extract_answer

pytestmark = pytest.mark.skipif(not (BUNDLED_DIR / "model.safetensors").exists(),
                                reason="bundled checkpoint not present")


def test_checkpoint_files_and_format():
    cfg = json.loads((BUNDLED_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert num_experts >= 16 and cfg["num_experts_per_tok"] >= 2
    assert (BUNDLED_DIR / "tokenizer.json").exists() and (BUNDLED_DIR / "README.md").exists()
    size = (BUNDLED_DIR / "model.safetensors").stat().st_size
    assert size <= 25 * 1024 * 1024
    with safe_open(str(BUNDLED_DIR / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
    # transformers 5.24 writes experts per expert (model.layers.L.mlp.experts.E.gate_proj.weight ...)
    # and fuses them into gate_up_proj / down_proj when loading
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.experts.{num_experts - 1}.{name}.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys


def test_loads_in_transformers_without_missing_keys():
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_greedy_accuracy_on_50_test_items():
    from moebench.suites.synth import format_prompt, load_synth_items
    from moebench.models.train import load_bundle

    torch.set_num_threads(2)
    model, tok = load_bundle(BUNDLED_DIR)
    items, _ = load_synth_items("test", 50)
    enc = tok([format_prompt(it.question) for it in items], return_tensors="pt", padding=True,
              add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=200, eos_token_id=EOS_ID,
                             pad_token_id=PAD_ID)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    correct = sum(extract_answer(t) == it.target for t, it in zip(texts, items))
    assert correct >= 43, f"{correct}/50 correct"
