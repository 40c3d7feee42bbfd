"""The MoE transformer forward (Qwen3-MoE and Mixtral): GQA attention with RoPE over a paged KV
cache, RMSNorm, and an MoE block that routes, asks the expert store for weights, and calls the
configured MoE kernel. Plain tensors, no autograd: the model is only ever run for inference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from moebench.engine.kv_cache import KVCache
from moebench.engine.loader import Checkpoint
from moebench.kernels.cpu_attention import DISABLE_ENV as DECODE_ATTENTION_ENV
from moebench.kernels.cpu_attention import paged_decode_attention
from moebench.kernels.reference import route_softmax_topk


@dataclass
class ForwardBatch:
    """Flattened new tokens of every sequence in a step, plus the block view attention reads."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    padded_index: torch.Tensor  # [N] position of each token in the [B * max_q] padded layout
    batch_size: int
    max_q: int
    context_blocks: torch.Tensor  # [B, max_blocks] KV blocks of each sequence's context, in order
    context_lens: torch.Tensor  # [B] context length of each sequence, this step's tokens included
    last_token_index: torch.Tensor  # [B] index into N of each sequence's last new token
    num_cached: list[int]  # tokens of each sequence already in the cache before this step
    block_size: int
    sliding_window: int | None
    dtype: torch.dtype

    @cached_property
    def attn_bias(self) -> torch.Tensor:
        """[B, 1, max_q, max_blocks * block_size]: 0 where attention is allowed, else -inf. Built on
        first use only: decode steps that run the paged decode kernel never need it."""
        q_pos = torch.tensor(self.num_cached)[:, None] + torch.arange(self.max_q)  # [B, max_q]
        k_pos = torch.arange(self.context_blocks.shape[1] * self.block_size)
        allowed = (k_pos <= q_pos[:, :, None]) & (k_pos < self.context_lens.cpu()[:, None, None])
        if self.sliding_window:
            allowed &= k_pos > q_pos[:, :, None] - self.sliding_window
        # An additive float mask: SDPA's CPU kernel runs faster with it than with a boolean one.
        bias = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))
        return bias[:, None].to(self.context_blocks.device)


def build_forward_batch(
    new_tokens: list[list[int]], num_cached: list[int], block_tables: list[list[int]],
    block_size: int, device: str, sliding_window: int | None = None, dtype: torch.dtype = torch.float32,
) -> ForwardBatch:
    """Index tensors of one step. Built from flat Python lists and a few whole-batch tensor ops,
    so the cost per sequence is list work, not tensor calls."""
    q_lens = [len(t) for t in new_tokens]
    B, max_q = len(new_tokens), max(q_lens)
    ctx_lens = [c + q for c, q in zip(num_cached, q_lens)]
    max_blocks = -(-max(ctx_lens) // block_size)
    input_ids, positions, slots, padded, blocks = [], [], [], [], []
    for b, (tokens, cached, table, ctx) in enumerate(zip(new_tokens, num_cached, block_tables, ctx_lens)):
        input_ids.extend(tokens)
        positions.extend(range(cached, ctx))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(cached, ctx))
        padded.extend(range(b * max_q, b * max_q + len(tokens)))
        used = table[: -(-ctx // block_size)]
        # Padding repeats a block of the sequence's own: any valid id does, the bias masks it out.
        blocks.extend(used + [used[0]] * (max_blocks - len(used)))
    last = torch.tensor(q_lens).cumsum(0) - 1
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, device=device),
        positions=torch.tensor(positions, device=device),
        slot_mapping=torch.tensor(slots, device=device),
        padded_index=torch.tensor(padded, device=device),
        batch_size=B,
        max_q=max_q,
        context_blocks=torch.tensor(blocks).view(B, max_blocks).to(device),
        context_lens=torch.tensor(ctx_lens, device=device),
        last_token_index=last.to(device),
        num_cached=list(num_cached),
        block_size=block_size,
        sliding_window=sliding_window,
        dtype=dtype,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op; the steps below are the same math for other dtypes
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, device, max_positions: int = 4096):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        self._build(max_positions)

    def _build(self, n: int):
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of `positions`, [N, 1, head_dim]: looked up once per forward, used by
        every layer's q and k."""
        if int(positions.max()) >= self.cos.shape[0]:
            self._build(2 * int(positions.max()) + 1)
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, head_dim]; rotate-half convention, as Hugging Face's Llama-family models."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class MoeTransformer:
    """Forward pass over a `Checkpoint`. `moe_block(layer, x)` is injected: it owns routing-to-output."""

    def __init__(self, ckpt: Checkpoint, moe_block):
        self.ckpt = ckpt
        self.cfg = ckpt.config
        self.moe_block = moe_block
        self.rope = RotaryEmbedding(self.cfg.head_dim, self.cfg.rope_theta, ckpt.embed.device)
        self.scale = self.cfg.head_dim ** -0.5
        # decode steps read the paged KV cache directly (kernels/cpu_attention.py) where the kernel
        # applies; MOEBENCH_DECODE_ATTENTION=torch keeps the gather + SDPA path
        self.fast_decode_attention = os.environ.get(DECODE_ATTENTION_ENV, "kernel") != "torch"

    def attention(self, x, layer_idx: int, batch: ForwardBatch, kv: KVCache, rope_tables) -> torch.Tensor:
        cfg, w = self.cfg, self.ckpt.layers[layer_idx]
        N = x.shape[0]
        q, k, v = F.linear(x, w.qkv_proj, w.qkv_bias).split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q = q.view(N, cfg.num_heads, cfg.head_dim)
        k = k.view(N, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(N, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q = self.rope.apply(q, *rope_tables)
        k = self.rope.apply(k, *rope_tables)
        kv.k[layer_idx].index_copy_(0, batch.slot_mapping, k)
        kv.v[layer_idx].index_copy_(0, batch.slot_mapping, v)

        B, Lq = batch.batch_size, batch.max_q
        if Lq == 1 and self.fast_decode_attention:
            out = paged_decode_attention(q.view(B, cfg.num_heads, cfg.head_dim), kv.k[layer_idx], kv.v[layer_idx],
                                         batch.context_blocks, batch.context_lens, kv.block_size, self.scale,
                                         cfg.sliding_window)
            if out is not None:
                return F.linear(out.view(B, cfg.num_heads * cfg.head_dim), w.o_proj)
        if Lq == 1:
            qp = q.view(B, 1, cfg.num_heads, cfg.head_dim)
        else:
            qp = q.new_zeros(B * Lq, cfg.num_heads, cfg.head_dim)
            qp[batch.padded_index] = q
            qp = qp.view(B, Lq, cfg.num_heads, cfg.head_dim)
        keys, values = kv.gather_blocks(layer_idx, batch.context_blocks)  # [B, ctx, kvh, hd]
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=batch.attn_bias, scale=self.scale, enable_gqa=True,
        )  # [B, heads, Lq, hd]
        out = out.transpose(1, 2).reshape(B * Lq, cfg.num_heads * cfg.head_dim)
        if Lq != 1:
            out = out[batch.padded_index]
        return F.linear(out, w.o_proj)

    def dense_mlp(self, x, layer_idx: int) -> torch.Tensor:
        w = self.ckpt.layers[layer_idx]
        gate, up = F.linear(x, w.dense_w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.dense_w2)

    def route(self, x, layer_idx: int):
        logits = F.linear(x, self.ckpt.layers[layer_idx].router)
        weights, ids = route_softmax_topk(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        return weights.to(x.dtype), ids

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, all_positions: bool = False) -> torch.Tensor:
        """Logits of each sequence's last new token, [B, vocab] float32 (every new token with all_positions)."""
        cfg = self.cfg
        h = self.ckpt.embed[batch.input_ids]
        rope_tables = self.rope.tables(batch.positions, h.dtype)
        for i, w in enumerate(self.ckpt.layers):
            h = h + self.attention(rms_norm(h, w.input_norm, cfg.rms_norm_eps), i, batch, kv, rope_tables)
            x = rms_norm(h, w.post_attention_norm, cfg.rms_norm_eps)
            h = h + (self.moe_block(i, x) if cfg.is_moe_layer(i) else self.dense_mlp(x, i))
        if not all_positions:
            h = h[batch.last_token_index]
        h = rms_norm(h, self.ckpt.final_norm, cfg.rms_norm_eps)
        return F.linear(h, self.ckpt.lm_head).float()
