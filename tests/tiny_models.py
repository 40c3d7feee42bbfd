"""Tiny random checkpoints written by `transformers` itself, so the engine is tested against the
reference implementation on exactly the files it would load in the field."""

from __future__ import annotations

from pathlib import Path

import torch

from moebench.models.random import write_char_tokenizer  # noqa: F401  (re-exported for tests)

FAMILIES = {
    # name: (family, overrides) — odd shapes on purpose: experts not a power of two,
    # head_dim != hidden / heads, top-k 1, 2 and 4, with and without top-k renormalisation.
    "qwen3_e6_k2_norm": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_e5_k1": ("qwen3_moe", dict(num_experts=5, num_experts_per_tok=1, norm_topk_prob=False)),
    "qwen3_e7_k4": ("qwen3_moe", dict(num_experts=7, num_experts_per_tok=4, norm_topk_prob=False)),
    "mixtral_e5_k2": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2)),
    "mixtral_e3_k1": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=1)),
}


def make_tiny_checkpoint(directory: Path, name: str = "qwen3_e6_k2_norm", seed: int = 0, vocab_size: int = 211,
                         dtype: torch.dtype = torch.float32, **extra) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    family, overrides = FAMILIES[name]
    common = dict(vocab_size=vocab_size, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, initializer_range=0.15, max_position_embeddings=512,
                  eos_token_id=None, pad_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    common.update(overrides)
    common.update(extra)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, **common)
        model = Qwen3MoeForCausalLM(config)
    else:
        config = MixtralConfig(intermediate_size=24, **common)
        model = MixtralForCausalLM(config)
    model = model.to(dtype).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def make_tiny_int4_checkpoint(directory: Path, tied: bool = False) -> Path:
    """A Qwen3-MoE whose every matrix's rows are a multiple of 32 wide (whole int4 groups)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                            num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.15,
                            max_position_embeddings=512, eos_token_id=None, pad_token_id=None, bos_token_id=None,
                            tie_word_embeddings=tied)
    Qwen3MoeForCausalLM(config).eval().save_pretrained(directory)
    return directory


def sharded_copy(ckpt, folder: Path):
    """`ckpt` rewritten into `folder` with its up projections in a second file (gate and down in the
    first): an expert is no longer one contiguous read. Returns the copy, loaded."""
    import json

    from safetensors.torch import load_file, save_file

    from moebench.engine import load_checkpoint

    tensors = load_file(str(ckpt.path / "model.safetensors"))
    shards = {"a.safetensors": {}, "b.safetensors": {}}
    for name, t in tensors.items():
        shards["b.safetensors" if "up_proj" in name else "a.safetensors"][name] = t
    for fname, part in shards.items():
        save_file(part, str(folder / fname), metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text((ckpt.path / "config.json").read_text())
    return load_checkpoint(folder)
