"""What a model family needs from an engine session: its block manager, its cache and its forward.

Qwen3-MoE and Mixtral run `MoeTransformer` over a paged K/V cache. Ling-3.0 (`bailing_hybrid`)
runs `HybridTransformer` over paged MLA latents plus one recurrent-state slot per resident request
(`moebench.engine.linear_state`); its block manager hands the slots out, so schedulers need not know."""

from __future__ import annotations


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

    block_manager = BlockManager(num_kv_blocks, runtime.kv_block_size)
    kv = KVCache(cfg.num_layers, num_kv_blocks, runtime.kv_block_size, cfg.num_kv_heads, cfg.head_dim,
                 runtime.torch_dtype, runtime.device)
    return block_manager, kv, MoeTransformer(ckpt, None)
