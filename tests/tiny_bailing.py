"""Tiny random `bailing_hybrid` (Ling-3.0) checkpoints written by `transformers` itself, in the
checkpoint naming it saves (the original Ling names: `attention.dense`, `q_conv1d`, `expert_bias`...).

Each shape varies what the family can vary: the hybrid layer pattern (`layer_group_size`: every
group's last layer is MLA, the rest KDA), the expert groups (`n_group` / `topk_group`), the query
projection (`q_lora_rank` set: low-rank with its own norm; unset: one projection), dense first layers,
shared experts, top-k renormalisation, the output bias of attention."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHAPES = {
    # 4 layers: KDA, MLA, KDA, MLA; 8 experts in 2 groups, 1 group used, top-2; one dense first layer
    "g2_ngroup2_topk1": dict(layer_group_size=2, num_hidden_layers=4, num_local_experts=8, n_group=2, topk_group=1,
                             num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None),
    # 5 layers: KDA, KDA, MLA, KDA, KDA; 12 experts in 4 groups, 2 used, top-3; low-rank queries; no dense
    # layer; two shared experts; no renormalisation
    "g3_ngroup4_topk2_qlora": dict(layer_group_size=3, num_hidden_layers=5, num_local_experts=12, n_group=4,
                                   topk_group=2, num_experts_per_tok=3, first_k_dense_replace=0, q_lora_rank=10,
                                   n_shared_experts=2, norm_topk_prob=False),
    # 3 layers, all MLA (group size 1); one group of 6 experts (no group limit), top-2; two dense layers
    "g1_all_mla_ngroup1": dict(layer_group_size=1, num_hidden_layers=3, num_local_experts=6, n_group=1,
                               topk_group=1, num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=None),
    # 4 layers: KDA, KDA, KDA, MLA, the unbounded forget gate; 10 experts in 5 groups, 3 used, top-4
    "g4_softplus_gate_ngroup5_topk3": dict(layer_group_size=4, num_hidden_layers=4, num_local_experts=10, n_group=5,
                                     topk_group=3, num_experts_per_tok=4, first_k_dense_replace=1,
                                     q_lora_rank=None, kda_safe_gate=False),
}


def make_tiny_bailing(directory: Path, shape: str = "g2_ngroup2_topk1", seed: int = 0, vocab_size: int = 97,
                      dtype: torch.dtype = torch.float32, expert_bias_scale: float = 0.1, **extra) -> Path:
    """A random checkpoint of `shape`. The router's expert bias (zero when transformers initialises
    it) is set to random values so that tests see it change which experts are chosen."""
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    params = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=12, kv_lora_rank=12, qk_rope_head_dim=8,
                  qk_nope_head_dim=6, v_head_dim=10, short_conv_kernel_size=4, initializer_range=0.15,
                  max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                  num_mtp_layers=0, tie_word_embeddings=False)
    params.update(SHAPES[shape])
    params.update(extra)
    torch.manual_seed(seed)
    model = BailingHybridForCausalLM(BailingHybridConfig(**params))
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0.0, expert_bias_scale)
    model = model.to(dtype).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def add_mtp_layer(directory: Path) -> list[str]:
    """Append an MTP layer's tensors (layer index num_hidden_layers, as Ling checkpoints store them)
    to the checkpoint, and count it in config.json. Plain decoding must load past them."""
    from safetensors.torch import load_file, save_file

    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    layer = config["num_hidden_layers"]
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(7)
    extra = {
        f"model.layers.{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g),
        f"model.layers.{layer}.enorm.weight": torch.ones(hidden),
        f"model.layers.{layer}.hnorm.weight": torch.ones(hidden),
        f"model.layers.{layer}.input_layernorm.weight": torch.ones(hidden),
        f"model.layers.{layer}.final_layernorm.weight": torch.ones(hidden),
    }
    weights_file = directory / "model.safetensors"
    tensors = load_file(weights_file)
    tensors.update(extra)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2))
    return sorted(extra)
