"""The model families behind one registry: how a family's config is parsed, its checkpoint loaded,
and what an engine session needs from it (block manager, cache, forward, bytes per step).

Qwen3-MoE and Mixtral run `MoeTransformer` over a paged K/V cache (engine/config.py, loader.py,
model.py). Ling-3.0 (`bailing_hybrid`) runs `HybridTransformer` over paged MLA latents plus one
recurrent-state slot per resident request (`moebench.engine.linear_state`); its block manager hands
the slots out, so schedulers need not know. This module sits above the families' own modules, which
import none of it: nothing below asks which family it is."""

from __future__ import annotations

from pathlib import Path

from moebench.errors import MoebenchError

SUPPORTED_FAMILIES = ("qwen3_moe", "mixtral", "bailing_hybrid")


def parse_model_config(path: Path):
    """A checkpoint's `config.json` as its family's config; an unknown architecture or a missing field
    is a one-line error naming the file."""
    from moebench.engine.config import parse_transformer_config, read_config_json

    raw = read_config_json(path)
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise MoebenchError(f"{path}: unknown model_type '{family}' (supported: {', '.join(SUPPORTED_FAMILIES)})")
    if family == "bailing_hybrid":  # Ling-3.0: its own layer kinds and router
        from moebench.engine.bailing_hybrid import parse_hybrid_config

        return parse_hybrid_config(raw, Path(path))
    return parse_transformer_config(raw, Path(path))


def load_checkpoint(path, device: str = "cpu", dtype=None, experts_in_checkpoint_dtype: bool = False,
                    load_experts: bool = True, overrides=None):
    """A checkpoint directory (safetensors) in the engine's weight layout, float32 unless `dtype` says.
    `experts_in_checkpoint_dtype`: keep routed experts on the CPU in the file's own dtype.
    `load_experts=False`: leave routed experts in the files for the disk tier (Qwen3-MoE, Mixtral).
    `overrides` (engine/overrides.py): the dense_weights and dense overrides decide a bfloat16
    checkpoint's dense weights' dtype."""
    import torch

    from moebench.engine.loader import TensorIndex, load_transformer_checkpoint

    directory = Path(path)
    if not directory.is_dir():
        raise MoebenchError(f"{directory}: not a directory (expected a checkpoint with config.json and *.safetensors)")
    cfg = parse_model_config(directory / "config.json")
    index = TensorIndex(directory)
    dtype = torch.float32 if dtype is None else dtype
    if cfg.family == "bailing_hybrid":
        from moebench.engine.bailing_hybrid import load_hybrid_checkpoint

        return load_hybrid_checkpoint(directory, cfg, index, device, dtype, experts_in_checkpoint_dtype)
    return load_transformer_checkpoint(directory, cfg, index, device, dtype, experts_in_checkpoint_dtype,
                                       load_experts, overrides)


def make_cache_and_model(ckpt, runtime, num_kv_blocks: int):
    """-> (block manager, cache, model with its moe_block still to be set)."""
    cfg = ckpt.config
    if cfg.family == "bailing_hybrid":
        from moebench.engine.bailing_hybrid import HybridTransformer, make_hybrid_cache
        from moebench.engine.scheduler import max_resident

        # one state slot per request the scheduler may keep resident, as the KV blocks are sized
        block_manager, cache = make_hybrid_cache(ckpt, num_kv_blocks, runtime.kv_block_size,
                                                 max_resident(runtime) + 1, runtime.torch_dtype, runtime.device)
        if runtime.lm_head != "f32":
            from moebench.errors import MoebenchError

            raise MoebenchError(f"--lm-head {runtime.lm_head}: the {cfg.family} model runs its LM head in float32 only")
        return block_manager, cache, HybridTransformer(ckpt, None, runtime.overrides)
    from moebench.engine.kv_cache import BlockManager, KVCache
    from moebench.engine.model import MoeTransformer

    block_manager = BlockManager(num_kv_blocks, runtime.kv_block_size)
    kv = KVCache(cfg.num_layers, num_kv_blocks, runtime.kv_block_size, cfg.num_kv_heads, cfg.head_dim,
                 runtime.torch_dtype, runtime.device)
    return block_manager, kv, MoeTransformer(ckpt, None, lm_head=runtime.lm_head, overrides=runtime.overrides)


def make_runner(ckpt, runtime, model, moe_block):
    """The session's step runner, once its model has its MoE block: the one place a session's decode
    path is decided (engine/decode_path.py); a family refuses a path it cannot run there."""
    from moebench.engine import decode_path
    from moebench.engine.store.factory import store_layout

    resident = store_layout(ckpt, runtime)[1] >= ckpt.config.num_experts
    runner = decode_path.decide(runtime.decode_path, model, runtime, moe_block, experts_resident=resident)
    model.runner = runner
    return runner


def non_expert_bytes_per_step(ckpt, element_size: int) -> int:
    """Bytes of weights every step reads besides the routed experts (the roofline's fixed part)."""
    import torch

    cfg = ckpt.config
    if cfg.family == "bailing_hybrid":  # its layers differ in kind: count what they hold
        skip = ("w13", "w2", "router", "expert_bias")
        held = sum(t.numel() for layer in ckpt.layers for name, t in vars(layer).items()
                   if isinstance(t, torch.Tensor) and name not in skip)
        return (held + cfg.vocab_size * cfg.hidden_size) * element_size
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    # the attention projections in the dtype they are held in (a bfloat16 checkpoint's stay so on
    # the CPU: loader.keeps_dense_in_checkpoint_dtype), the LM head in its own
    dense = torch.empty(0, dtype=ckpt.dense_dtype).element_size()
    head = cfg.vocab_size * cfg.hidden_size * ckpt.lm_head.element_size()
    if getattr(ckpt, "weights", "f32") != "f32":  # --weights int8: the matrices as held, with their scales
        return sum(w.qkv_proj.nbytes + w.o_proj.nbytes for w in ckpt.layers) + head
    return cfg.num_layers * attn * dense + head


def cache_bytes_per_step(cfg, context_tokens: int, num_sequences: int, element_size: int) -> int:
    """Bytes of per-request cache a step reads: K/V of every context token, or for a hybrid model
    the MLA latents of every context token plus each sequence's fixed-size KDA state."""
    per_token, per_sequence = cache_bytes_rates(cfg, element_size)
    return context_tokens * per_token + num_sequences * per_sequence


def cache_bytes_rates(cfg, element_size: int) -> tuple[int, int]:
    """(bytes per context token, bytes per sequence) of the cache a step reads: per-model constants,
    so a session works them out once and each step multiplies (cache_bytes_per_step)."""
    if cfg.family == "bailing_hybrid":
        latents = len(cfg.mla_layers) * cfg.head_dim * element_size
        kda_state = 4 * cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim  # float32
        kda_conv = element_size * 3 * cfg.kda_heads * cfg.kda_head_dim * (cfg.conv_kernel - 1)
        return latents, len(cfg.kda_layers) * (kda_state + kda_conv)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element_size, 0
