"""Attention over the paged KV cache: whole-block gathers return what token-by-token indexing would,
and decoding sequences whose blocks are scattered through the pool, in one padded batch of mixed
context lengths, gives the logits of running each sequence alone over contiguous blocks."""

import pytest
import torch

from moebench.engine import load_checkpoint
from moebench.engine.store.expert_store import NoPrefetch, ResidentStore
from moebench.engine.kv_cache import KVCache
from moebench.engine.model import MoeTransformer, build_forward_batch
from moebench.engine.moe import MoeBlock, make_kernel
from moebench.engine.moe import RoutingStats
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


@pytest.mark.parametrize("decode_kernel", [True, False], ids=["paged-kernel", "gather-sdpa"])
def test_batched_decode_over_scattered_blocks_equals_each_sequence_alone(tmp_path, decode_kernel):
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path, "qwen3_e7_k4"))
    model = _model(ckpt)
    model.fast_decode_attention = decode_kernel
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
    # both decode paths compute the same attention
    model.fast_decode_attention = not decode_kernel
    assert (_decode_logits(model, ckpt, prompts, tables, sum(need)) - together).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [None, 6])
def test_decode_attention_kernel_matches_reference(window):
    """The C++ paged decode attention against the per-sequence torch reference: GQA, scattered
    blocks, contexts of 1 token to several blocks, with and without a sliding window."""
    from moebench.kernels.cpu_attention import paged_decode_attention, paged_decode_attention_reference

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 16, 4, 40
    k_pool = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    lens = torch.tensor([1, 5, 17, 30, 9])
    blocks = torch.randperm(num_blocks, generator=g)[: 5 * 8].view(5, 8)
    q = torch.randn(5, heads, dim, generator=g)
    out = paged_decode_attention(q, k_pool, v_pool, blocks, lens, block_size, 0.25, window)
    if out is None:
        pytest.skip("the CPU extension is not available")
    ref = paged_decode_attention_reference(q, k_pool, v_pool, blocks, lens, block_size, 0.25, window)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_kernel_refuses_a_block_outside_the_pool():
    from moebench.kernels.cpu_attention import paged_decode_attention
    from moebench.kernels.cpu_moe import load_extension

    if load_extension() is None:
        pytest.skip("the CPU extension is not available")
    q, pool = torch.randn(1, 2, 8), torch.randn(16, 1, 8)
    out = None
    with pytest.raises(RuntimeError, match="outside the pool"):
        out = paged_decode_attention(q, pool, pool, torch.tensor([[9]]), torch.tensor([3]), 4, 1.0)
    assert out is None
