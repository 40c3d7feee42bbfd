"""Attention over the paged KV cache: whole-block gathers return what token-by-token indexing would,
and decoding sequences whose blocks are scattered through the pool, in one padded batch of mixed
context lengths, gives the logits of running each sequence alone over contiguous blocks."""

import torch

from moebench.engine import load_checkpoint
from moebench.engine.expert_store import NoPrefetch, ResidentStore
from moebench.engine.kv_cache import KVCache
from moebench.engine.model import MoeTransformer, build_forward_batch
from moebench.engine.moe import MoeBlock, make_kernel
from moebench.engine.routing_stats import RoutingStats
from tiny_models import make_tiny_checkpoint

BLOCK = 4


def test_gather_blocks_matches_token_indexing():
    kv = KVCache(2, 10, BLOCK, 2, 3, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    kv.k[1].copy_(torch.randn(kv.k[1].shape, generator=g))
    kv.v[1].copy_(torch.randn(kv.v[1].shape, generator=g))
    blocks = torch.tensor([[7, 2, 5], [3, 3, 3]])
    slots = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)  # [B, 3 * BLOCK]
    keys, values = kv.gather_blocks(1, blocks)
    assert torch.equal(keys, kv.k[1][slots]) and torch.equal(values, kv.v[1][slots])
    # the buffer is reused, and a smaller request after a larger one still reads the right blocks
    keys, _ = kv.gather_blocks(1, blocks[1:, :1])
    assert torch.equal(keys, kv.k[1][slots[1:, :BLOCK]])


def _model(ckpt):
    model = MoeTransformer(ckpt, None)
    stats = RoutingStats(ckpt.config.num_layers, ckpt.config.num_experts)
    model.moe_block = MoeBlock(model.route, make_kernel("naive"), ResidentStore(ckpt), NoPrefetch(), stats)
    return model


def _decode_logits(model, ckpt, prompts, tables, num_blocks):
    """Prefill every prompt but its last token, then one decode step of all of them together."""
    cfg = ckpt.config
    kv = KVCache(cfg.num_layers, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    for ids, table in zip(prompts, tables):
        model.forward(build_forward_batch([ids[:-1]], [0], [table], BLOCK, "cpu"), kv)
    batch = build_forward_batch([ids[-1:] for ids in prompts], [len(ids) - 1 for ids in prompts], tables, BLOCK, "cpu")
    return model.forward(batch, kv)


def test_batched_decode_over_scattered_blocks_equals_each_sequence_alone(tmp_path):
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path, "qwen3_e7_k4"))
    model = _model(ckpt)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, ckpt.config.vocab_size, (n,), generator=g).tolist() for n in (3, 14, 9, 22)]
    need = [-(-len(p) // BLOCK) for p in prompts]
    pool = torch.randperm(sum(need), generator=g).tolist()  # blocks scattered and interleaved
    tables, start = [], 0
    for n in need:
        tables.append(pool[start:start + n])
        start += n
    together = _decode_logits(model, ckpt, prompts, tables, sum(need))
    for i, ids in enumerate(prompts):
        alone = _decode_logits(model, ckpt, [ids], [list(range(need[i]))], need[i])
        assert (together[i] - alone[0]).abs().max().item() <= 1e-5
