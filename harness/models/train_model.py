"""The training model of the bundled default: transformers' Qwen3MoE forward in plain PyTorch, with
the experts as one capacity-padded batched matmul (training needs a backward, which
torch._grouped_mm lacks on the CPU). Parameter names and shapes are transformers' own, so the
state dict loads straight into ``Qwen3MoeForCausalLM`` (`to_hf`)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = c.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class Experts(nn.Module):
    def __init__(self, c):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))


class Router(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))


class SparseMoe(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.E, self.k, self.norm_topk = c.num_experts, c.num_experts_per_tok, c.norm_topk_prob
        self.experts = Experts(c)
        self.gate = Router(c)

    def forward(self, x, valid):
        """x [N, H]; valid [N] bool. Returns (out [N, H], aux loss, per-expert counts)."""
        N, H = x.shape
        E, k = self.E, self.k
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        topv, topi = torch.topk(probs, k, dim=-1)
        if self.norm_topk:
            topv = topv / topv.sum(-1, keepdim=True)
        topv = topv.to(x.dtype)
        with torch.no_grad():
            flat_e = topi.reshape(-1)
            order = torch.argsort(flat_e, stable=True)
            counts = torch.bincount(flat_e, minlength=E)
            tok = order // k
        # tokens sorted by expert, one exactly-sized matmul per expert (no padding)
        xs = x[tok]
        parts = []
        for e, xe in enumerate(xs.split(counts.tolist())):
            if xe.shape[0] == 0:
                continue
            g, u = F.linear(xe, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            parts.append(F.linear(F.silu(g) * u, self.experts.down_proj[e]))
        o = torch.cat(parts)
        y = o * topv.reshape(-1)[order, None]
        out = x.new_zeros(N, H).index_add(0, tok, y)
        # Switch-style load-balancing loss over real (non-pad) tokens
        vm = valid.float()
        nvalid = vm.sum().clamp_min(1.0)
        with torch.no_grad():
            assign = torch.zeros(N, E).scatter_(1, topi, 1.0) * vm[:, None]
            vcounts = assign.sum(0)
            frac = vcounts / (nvalid * k)
        pmean = (probs * vm[:, None]).sum(0) / nvalid
        aux = E * (frac * pmean).sum()
        return out, aux, vcounts


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = SparseMoe(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, valid):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        B, T, H = x.shape
        m, aux, counts = self.mlp(self.post_attention_layernorm(x).view(B * T, H), valid)
        return x + m.view(B, T, H), aux, counts


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TrainModel(nn.Module):
    """Same parameters (names, shapes, math) as transformers' Qwen3MoeForCausalLM."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        hd = c.head_dim
        theta = c.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def init_weights(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        L = self.c.num_hidden_layers
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj")):
                with torch.no_grad():
                    p.normal_(0.0, std / math.sqrt(2 * L), generator=g)
            else:
                with torch.no_grad():
                    p.normal_(0.0, std, generator=g)

    def forward(self, ids, valid):
        B, T = ids.shape
        x = self.model.embed_tokens(ids)
        pos = torch.arange(T, dtype=torch.float)
        fr = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((fr, fr), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        vflat = valid.reshape(-1)
        aux_total = x.new_zeros(())
        all_counts = []
        for layer in self.model.layers:
            x, aux, counts = layer(x, cos, sin, vflat)
            aux_total = aux_total + aux
            all_counts.append(counts)
        x = self.model.norm(x)
        logits = F.linear(x, self.model.embed_tokens.weight)
        return logits, aux_total, torch.stack(all_counts)

    def hf_state_dict(self):
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd


def to_hf(model: TrainModel, bf16_round: bool = True):
    """A transformers Qwen3MoeForCausalLM (float32 compute) with this model's weights."""
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM(model.c).float().eval()
    sd = model.hf_state_dict()
    if bf16_round:
        sd = {k: v.to(torch.bfloat16).float() for k, v in sd.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping mismatch: missing={missing} unexpected={unexpected}")
    hf.tie_weights()
    return hf
