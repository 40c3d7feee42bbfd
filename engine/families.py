"""What a model family needs from an engine session: its block manager, its cache and its forward.

Qwen3-MoE and Mixtral run `MoeTransformer` over a paged K/V cache. Ling-3.0 (`bailing_hybrid`)
runs `HybridTransformer` over paged MLA latents plus one recurrent-state slot per resident request
(`moebench.engine.linear_state`); its block manager hands the slots out, so schedulers need not know."""

from __future__ import annotations

import torch


def make_cache_and_model(ckpt, runtime, num_kv_blocks: int):
    """-> (block manager, cache, model with its moe_block still to be set)."""
    cfg = ckpt.config
    if cfg.family == "bailing_hybrid":
        from moebench.engine.bailing_hybrid import HybridTransformer, make_hybrid_cache
        from moebench.engine.scheduler import max_resident

        # one state slot per request the scheduler may keep resident, as the KV blocks are sized
        block_manager, cache = make_hybrid_cache(ckpt, num_kv_blocks, runtime.kv_block_size,
                                                 max_resident(runtime) + 1, runtime.torch_dtype, runtime.device)
        return block_manager, cache, HybridTransformer(ckpt, None)
    from moebench.engine.kv_cache import BlockManager, KVCache
    from moebench.engine.model import MoeTransformer

    from moebench.engine import decode_path

    block_manager = BlockManager(num_kv_blocks, runtime.kv_block_size)
    kv = KVCache(cfg.num_layers, num_kv_blocks, runtime.kv_block_size, cfg.num_kv_heads, cfg.head_dim,
                 runtime.torch_dtype, runtime.device)
    model = MoeTransformer(ckpt, None)
    # the one place a session's decode path is decided (engine/decode_path.py)
    model.decode_path = decode_path.decide(runtime.decode_path, model, runtime)
    return block_manager, kv, model


def non_expert_bytes_per_step(ckpt, element_size: int) -> int:
    """Bytes of weights every step reads besides the routed experts (the roofline's fixed part)."""
    cfg = ckpt.config
    if cfg.family == "bailing_hybrid":  # its layers differ in kind: count what they hold
        skip = ("w13", "w2", "router", "expert_bias")
        held = sum(t.numel() for layer in ckpt.layers for name, t in vars(layer).items()
                   if isinstance(t, torch.Tensor) and name not in skip)
        return (held + cfg.vocab_size * cfg.hidden_size) * element_size
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return (cfg.num_layers * attn + cfg.vocab_size * cfg.hidden_size) * element_size


def cache_bytes_per_step(cfg, context_tokens: int, num_sequences: int, element_size: int) -> int:
    """Bytes of per-request cache a step reads: K/V of every context token, or for a hybrid model
    the MLA latents of every context token plus each sequence's fixed-size KDA state."""
    if cfg.family == "bailing_hybrid":
        latents = context_tokens * len(cfg.mla_layers) * cfg.head_dim * element_size
        kda_state = 4 * cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim  # float32
        kda_conv = element_size * 3 * cfg.kda_heads * cfg.kda_head_dim * (cfg.conv_kernel - 1)
        return latents + num_sequences * len(cfg.kda_layers) * (kda_state + kda_conv)
    return context_tokens * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element_size
