"""The Ling-3.0 family (`model_type: bailing_hybrid`): hybrid attention and grouped sigmoid routing.

Layers come in groups of `layer_group_size`; the last layer of each group is multi-head latent
attention (MLA), the others Kimi Delta Attention (KDA), a gated delta-rule linear attention:
- MLA keeps one compressed latent per token (the RMS-normalised KV latent and a shared key part
  that carries rotary position, kv_lora_rank + qk_rope_head_dim numbers). Attention runs on the
  latents directly: each head's no-position query is taken into latent space through that head's
  key up-projection, keys are the latents themselves, and the latent-space output goes back
  through the head's value up-projection. That is the same product as expanding every cached
  latent into per-head keys and values, without materialising them. A sigmoid gate per head scales
  the output (Ling's output gate).
- KDA projects q, k, v, runs each through a causal depthwise convolution (kernel
  `short_conv_kernel_size`) and SiLU, L2-normalises q and k, and keeps a state S [key dim, value dim]
  per head: each token decays S per key channel (the forget gate, exp of a negative log-decay),
  then writes k (beta * (v - k^T S)) into it (the delta rule), and reads q^T S. Decode steps update
  S token by token; prefill runs the same recurrence chunk by chunk (engine/kda.py).
  The output goes through an RMSNorm gated by sigmoid(g_proj(x)).
The MLP is dense in the first layers, else a routed MoE with a shared expert. The router scores
experts with a sigmoid, adds a per-expert correction bias only to choose them, keeps the best
`topk_group` of `n_group` groups, takes the top-k there, renormalises the unbiased scores and
multiplies them by `routed_scaling_factor`. Routed experts go through the engine's one MoE
interface (`MoeBlock`: store, prefetcher, naive or fused kernel); the shared expert is added to
the residual before it.

Per-request state lives in `moebench.engine.linear_state` (paged latents, state slots). MTP layers
(stored after the decoder layers) are not used by plain decoding and are not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moebench.engine import memory
from moebench.engine.config import ModelConfig, _rope_theta
from moebench.engine.kda import delta_rule_chunked, delta_rule_step, l2_normalize, slot_runs
from moebench.engine.linear_state import HybridCache, StateBlockManager
from moebench.engine.memory import to_huge_pages
from moebench.engine.model import ForwardBatch, RotaryEmbedding, rms_norm
from moebench.errors import MoebenchError
from moebench.kernels import route
from moebench.engine.overrides import DEFAULT as NO_OVERRIDES
from moebench.kernels import cpu_dense

FAMILY = "bailing_hybrid"
MLA, KDA = "mla", "kda"
LATENT_NORM_EPS = 1e-6  # the query and KV latent norms use this, not rms_norm_eps, in the reference


@dataclass(frozen=True)
class HybridModelConfig(ModelConfig):
    """`ModelConfig` plus what Ling's layers need. For the generic fields: `num_kv_heads` is 1 and
    `head_dim` the latent width (kv_lora_rank + qk_rope_head_dim), what an MLA layer caches per token."""

    layer_kinds: tuple[str, ...] = ()  # MLA or KDA per layer
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    kda_heads: int = 0
    kda_head_dim: int = 0
    conv_kernel: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    num_mtp_layers: int = 0

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == MLA]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == KDA]


def _field(raw: dict, path: Path, *names, default=None, required: bool = False):
    """The first of `names` present in config.json (Ling's own names and transformers' aliases)."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    if required:
        raise MoebenchError(f"{path}: missing field '{names[0]}'")
    return default


def parse_hybrid_config(raw: dict, path: Path) -> HybridModelConfig:
    layers = int(_field(raw, path, "num_hidden_layers", required=True))
    heads = int(_field(raw, path, "num_attention_heads", required=True))
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise MoebenchError(f"{path}: hidden_act '{act}' is not supported (only silu)")
    group_size = int(_field(raw, path, "layer_group_size", default=6))
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % group_size == 0 else "linear_attention" for i in range(layers)]
    kinds = []
    for t in types[:layers]:
        if t not in ("full_attention", "linear_attention"):
            raise MoebenchError(f"{path}: layer type '{t}' is not supported (full_attention or linear_attention)")
        kinds.append(MLA if t == "full_attention" else KDA)
    if len(kinds) != layers:
        raise MoebenchError(f"{path}: layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    first_dense = int(_field(raw, path, "first_k_dense_replace", default=0))
    mlp_types = raw.get("mlp_layer_types") or ["dense" if i < first_dense else "sparse" for i in range(layers)]
    dense = tuple(i for i, t in enumerate(mlp_types[:layers]) if t == "dense")
    num_experts = int(_field(raw, path, "num_experts", "num_local_experts", required=True))
    n_group = int(_field(raw, path, "n_group", "num_expert_group", default=1))
    if n_group < 1 or num_experts % n_group:
        raise MoebenchError(f"{path}: {num_experts} experts do not split into n_group={n_group} groups")
    topk_group = int(_field(raw, path, "topk_group", default=n_group))
    top_k = int(_field(raw, path, "num_experts_per_tok", "num_experts_per_token", required=True))
    if not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
        raise MoebenchError(f"{path}: top-{top_k} of {topk_group} kept groups of {num_experts // n_group} "
                            f"experts is not possible")
    kv_lora = int(_field(raw, path, "kv_lora_rank", required=True))
    rope_dim = int(_field(raw, path, "qk_rope_head_dim", required=True))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    q_lora = raw.get("q_lora_rank")
    conv_kernel = int(_field(raw, path, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4))
    if conv_kernel < 2:
        raise MoebenchError(f"{path}: short_conv_kernel_size {conv_kernel} is not supported (at least 2)")
    return HybridModelConfig(
        family=FAMILY,
        vocab_size=int(_field(raw, path, "vocab_size", required=True)),
        hidden_size=int(_field(raw, path, "hidden_size", required=True)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=kv_lora + rope_dim,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=int(_field(raw, path, "moe_intermediate_size", required=True)),
        norm_topk_prob=bool(_field(raw, path, "norm_topk_prob", "moe_renormalize", default=True)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw),
        tie_word_embeddings=False,  # the family never ties, whatever the flag says (see load_hybrid_checkpoint)
        qk_norm=False,
        attention_bias=bool(raw.get("attention_bias", False)),
        sliding_window=None,
        dense_layers=dense,
        dense_intermediate_size=int(_field(raw, path, "intermediate_size", default=0)),
        eos_token_ids=eos_ids,
        max_position_embeddings=int(_field(raw, path, "max_position_embeddings", "model_max_length", default=32768)),
        layer_kinds=tuple(kinds),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=int(_field(raw, path, "qk_nope_head_dim", required=True)),
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(_field(raw, path, "v_head_dim", required=True)),
        # transformers writes linear_* beside head_dim, which it overwrites with qk_rope_head_dim
        kda_heads=int(_field(raw, path, "linear_num_heads", "num_attention_heads")),
        kda_head_dim=int(_field(raw, path, "linear_head_dim", "head_dim", required=True)),
        conv_kernel=conv_kernel,
        kda_safe_gate=bool(raw.get("kda_safe_gate", True)),
        kda_lower_bound=float(raw.get("kda_lower_bound", -5.0)),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_shared_experts=int(_field(raw, path, "n_shared_experts", "num_shared_experts", default=0)),
        num_mtp_layers=int(_field(raw, path, "num_mtp_layers", "num_nextn_predict_layers", default=0)),
    )


@dataclass
class HybridLayerWeights:
    kind: str
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    o_proj: torch.Tensor  # [H, heads * v_head_dim] (MLA) or [H, kda_heads * kda_head_dim] (KDA)
    o_bias: torch.Tensor | None = None
    # MLA: one matmul for [query (or its low-rank down-projection) | kv latent + rope key | gate]
    mla_in_proj: torch.Tensor | None = None
    mla_in_bias: torch.Tensor | None = None
    q_a_norm: torch.Tensor | None = None
    q_b_proj: torch.Tensor | None = None
    kv_a_norm: torch.Tensor | None = None
    w_uk: torch.Tensor | None = None  # [heads, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor | None = None  # [heads, v_head_dim, kv_lora_rank]
    # KDA: one matmul for [q | k | v | forget gate | output gate | beta]
    kda_in_proj: torch.Tensor | None = None
    conv_weight: torch.Tensor | None = None  # [3 * heads * head_dim, kernel] (float32, as the reference keeps it)
    dt_bias: torch.Tensor | None = None  # [heads * head_dim]
    decay_rate: torch.Tensor | None = None  # exp(A_log), [heads]
    out_norm: torch.Tensor | None = None  # [head_dim]
    # MLP
    router: torch.Tensor | None = None  # [E, H] (float32)
    expert_bias: torch.Tensor | None = None  # [E] (float32)
    w13: torch.Tensor | None = None  # [E, 2I, H]
    w2: torch.Tensor | None = None  # [E, H, I]
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    dense_w13: torch.Tensor | None = None
    dense_w2: torch.Tensor | None = None


def _deinterleave(rows: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Reorder the rotary rows (the last `rope_dim` of `rows`' leading dimension) from interleaved
    pairs (x0, x1), (x2, x3)... to halves (x0, x2, ...), (x1, x3, ...). Ling rotates interleaved
    pairs; after this reordering of the projection producing q and k, the usual rotate-half RoPE
    computes the very same dot products (q and k are permuted alike)."""
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    head = rows[: rows.shape[0] - rope_dim]
    rope = rows[rows.shape[0] - rope_dim:][order]
    return torch.cat([head, rope])


def load_hybrid_checkpoint(directory: Path, cfg: HybridModelConfig, index, device: str, dtype: torch.dtype,
                           experts_in_checkpoint_dtype: bool = False):
    """Weights of a `bailing_hybrid` checkpoint, in Ling's own tensor names (as transformers saves
    them) or transformers' in-memory names."""
    from moebench.engine.loader import assemble_checkpoint

    def pick(*names: str) -> str:
        for n in names:
            if n in index:
                return n
        raise MoebenchError(f"{directory}: missing tensor '{names[0]}'")

    def get(name: str, *shape: int, keep_float32: bool = False) -> torch.Tensor:
        return index.get(name, shape).to(device=device, dtype=torch.float32 if keep_float32 else dtype)

    H, heads, E, I = cfg.hidden_size, cfg.num_heads, cfg.num_experts, cfg.moe_intermediate_size
    embed_name = pick("model.word_embeddings.weight", "model.embed_tokens.weight")
    checkpoint_dtype = index._open(index.name_to_file[embed_name]).get_slice(embed_name).get_dtype()
    embed = get(embed_name, cfg.vocab_size, H)
    # transformers' bailing_hybrid never ties the output layer to the embeddings (its
    # _tied_weights_keys is empty): whatever tie_word_embeddings says, it loads and uses
    # lm_head.weight, so this runtime does too; a checkpoint without one has no defined output layer
    if "lm_head.weight" not in index:
        raise MoebenchError(f"{directory}: missing tensor 'lm_head.weight' (Ling-3.0's reference implementation "
                            "never ties it to the embeddings, whatever tie_word_embeddings says)")
    lm_head = get("lm_head.weight", cfg.vocab_size, H)

    layers, expert_sources = [], {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        attn = f"{p}.attention" if f"{p}.attention.dense.weight" in index else f"{p}.self_attn"
        kind = cfg.layer_kinds[i]
        if kind == MLA:
            nope, rope, v, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            qk = nope + rope
            o_rows = heads * v
        else:
            D = cfg.kda_heads * cfg.kda_head_dim
            o_rows = D
        layer = HybridLayerWeights(
            kind=kind,
            input_norm=get(f"{p}.input_layernorm.weight", H),
            post_attention_norm=get(f"{p}.post_attention_layernorm.weight", H),
            o_proj=get(pick(f"{attn}.dense.weight", f"{attn}.o_proj.weight"), H, o_rows),
        )
        if kind == MLA:
            bias = cfg.attention_bias
            if cfg.q_lora_rank is None:
                q_rows = get(pick(f"{attn}.q_proj.weight"), heads * qk, H)
                q_rows = torch.cat([_deinterleave(r, rope) for r in q_rows.view(heads, qk, H)])
                q_bias = torch.zeros(heads * qk, dtype=dtype, device=device)
            else:
                r = cfg.q_lora_rank
                q_rows = get(f"{attn}.q_a_proj.weight", r, H)
                q_bias = get(f"{attn}.q_a_proj.bias", r) if bias else torch.zeros(r, dtype=dtype, device=device)
                layer.q_a_norm = get(f"{attn}.q_a_layernorm.weight", r)
                q_b = get(f"{attn}.q_b_proj.weight", heads * qk, r)
                layer.q_b_proj = torch.cat([_deinterleave(rows, rope) for rows in q_b.view(heads, qk, r)])
            kv_a = _deinterleave(get(f"{attn}.kv_a_proj_with_mqa.weight", lora + rope, H), rope)
            kv_a_bias = (_deinterleave(get(f"{attn}.kv_a_proj_with_mqa.bias", lora + rope), rope) if bias
                         else torch.zeros(lora + rope, dtype=dtype, device=device))
            gate = get(f"{attn}.g_proj.weight", heads, H)
            layer.mla_in_proj = torch.cat([q_rows, kv_a, gate])
            if bias:
                layer.mla_in_bias = torch.cat([q_bias, kv_a_bias, torch.zeros(heads, dtype=dtype, device=device)])
            layer.kv_a_norm = get(f"{attn}.kv_a_layernorm.weight", lora)
            kv_b = get(f"{attn}.kv_b_proj.weight", heads * (nope + v), lora).view(heads, nope + v, lora)
            layer.w_uk = kv_b[:, :nope].contiguous()
            layer.w_uv = kv_b[:, nope:].contiguous()
            if bias:
                layer.o_bias = get(pick(f"{attn}.dense.bias", f"{attn}.o_proj.bias"), H)
        else:
            hd, K = cfg.kda_head_dim, cfg.conv_kernel
            if f"{attn}.q_conv1d.weight" in index:
                conv = torch.cat([get(f"{attn}.{n}_conv1d.weight", D, 1, K, keep_float32=True) for n in "qkv"])
            else:
                conv = get(f"{attn}.conv1d.weight", 3 * D, 1, K, keep_float32=True)
            gate_prefix = attn if f"{attn}.f_proj.weight" in index else f"{attn}.forget_gate"
            layer.kda_in_proj = torch.cat([
                get(f"{attn}.q_proj.weight", D, H), get(f"{attn}.k_proj.weight", D, H),
                get(f"{attn}.v_proj.weight", D, H), get(f"{gate_prefix}.f_proj.weight", D, H),
                get(f"{attn}.g_proj.weight", D, H), get(f"{attn}.b_proj.weight", cfg.kda_heads, H)])
            layer.conv_weight = conv[:, 0]
            layer.dt_bias = get(f"{gate_prefix}.dt_bias", D, keep_float32=True)
            layer.decay_rate = get(f"{gate_prefix}.A_log", cfg.kda_heads, keep_float32=True).exp()
            layer.out_norm = get(f"{attn}.o_norm.weight", hd, keep_float32=True)
        m = f"{p}.mlp"
        if cfg.is_moe_layer(i):
            layer.router = get(f"{m}.gate.weight", E, H, keep_float32=True)
            layer.expert_bias = get(pick(f"{m}.gate.expert_bias", f"{m}.gate.e_score_correction_bias"), E,
                                    keep_float32=True)
            if f"{m}.experts.gate_up_proj" in index:  # transformers' in-memory fused layout
                layer.w13 = to_huge_pages(get(f"{m}.experts.gate_up_proj", E, 2 * I, H))
                layer.w2 = to_huge_pages(get(f"{m}.experts.down_proj", E, H, I))
            else:
                first = f"{m}.experts.0.gate_proj.weight"
                e_device, e_dtype = (("cpu", index.get(first, (I, H)).dtype) if experts_in_checkpoint_dtype
                                     else (device, dtype))
                layer.w13 = memory.empty((E, 2 * I, H), e_dtype, e_device)
                layer.w2 = memory.empty((E, H, I), e_dtype, e_device)
                for e in range(E):
                    names = [f"{m}.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")]
                    # copy_ converts the file's dtype on the way: no intermediate tensor per expert
                    layer.w13[e, :I].copy_(index.get(names[0], (I, H)))
                    layer.w13[e, I:].copy_(index.get(names[1], (I, H)))
                    layer.w2[e].copy_(index.get(names[2], (H, I)))
                    expert_sources[(i, e)] = [(index.name_to_file[n], n) for n in names]
            S = I * cfg.num_shared_experts
            if S:
                s = f"{m}.shared_experts"
                layer.shared_w13 = torch.cat([get(f"{s}.gate_proj.weight", S, H), get(f"{s}.up_proj.weight", S, H)])
                layer.shared_w2 = get(f"{s}.down_proj.weight", H, S)
        else:
            Dn = cfg.dense_intermediate_size
            layer.dense_w13 = torch.cat([get(f"{m}.gate_proj.weight", Dn, H), get(f"{m}.up_proj.weight", Dn, H)])
            layer.dense_w2 = get(f"{m}.down_proj.weight", H, Dn)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor) and name not in ("w13", "w2"):
                setattr(layer, name, to_huge_pages(value))
        layers.append(layer)

    return assemble_checkpoint(directory, cfg, embed, lm_head, get("model.norm.weight", H), layers,
                               checkpoint_dtype, index.files(), expert_sources)


class HybridTransformer:
    """Forward pass of a `bailing_hybrid` checkpoint over a `HybridCache`. Same calling convention
    as `MoeTransformer`: `moe_block(layer, x, h)` is injected and returns h + its routed output."""

    def __init__(self, ckpt, moe_block, overrides=NO_OVERRIDES):
        self.ckpt = ckpt
        # the dense projections' op, bound once (the dense override: torch everywhere)
        self.linear = cpu_dense.linear if overrides.dense == "kernel" else cpu_dense.torch_linear
        self.cfg: HybridModelConfig = ckpt.config
        self.moe_block = moe_block
        cfg = self.cfg
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, ckpt.embed.device) if cfg.mla_layers else None
        self.mla_scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        self.kda_dim = cfg.kda_heads * cfg.kda_head_dim

    def route(self, x, layer_idx: int):
        cfg, w = self.cfg, self.ckpt.layers[layer_idx]
        logits = F.linear(x.float(), w.router)
        weights, ids = route(logits, cfg.top_k, cfg.norm_topk_prob, scoring="sigmoid",
                             e_score_correction_bias=w.expert_bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                             routed_scaling_factor=cfg.routed_scaling_factor)
        return weights.to(x.dtype), ids.contiguous()

    def mla(self, x, i: int, batch: ForwardBatch, cache: HybridCache, rope_tables) -> torch.Tensor:
        cfg, w = self.cfg, self.ckpt.layers[i]
        N, heads = x.shape[0], cfg.num_heads
        nope, rope, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        B, Lq = batch.batch_size, batch.max_q
        q_width = heads * (nope + rope) if cfg.q_lora_rank is None else cfg.q_lora_rank
        q, kv, gate = self.linear(x, w.mla_in_proj, w.mla_in_bias).split([q_width, lora + rope, heads], dim=-1)
        if cfg.q_lora_rank is not None:
            q = self.linear(rms_norm(q, w.q_a_norm, LATENT_NORM_EPS), w.q_b_proj)
        q_nope, q_rot = q.view(N, heads, nope + rope).split([nope, rope], dim=-1)
        q_rot = self.rope.apply(q_rot, *rope_tables)
        k_rot = self.rope.apply(kv[:, None, lora:], *rope_tables)[:, 0]
        latent = torch.cat([rms_norm(kv[:, :lora], w.kv_a_norm, LATENT_NORM_EPS), k_rot], dim=-1)
        cache.latent[i].index_copy_(0, batch.slot_mapping, latent)
        # each head's query in latent space: q_nope @ W_uk[h]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # [N, heads, lora]
        query = torch.cat([q_latent, q_rot], dim=-1)
        context = cache.gather_latent(i, batch.context_blocks)  # [B, ctx, lora + rope]
        if Lq == 1:
            # every head attends to the same latents: two batched matmuls over [heads, ctx], where
            # SDPA would first expand the one latent "head" to all of them
            scores = torch.baddbmm(batch.attn_bias[:, 0], query.view(B, heads, lora + rope), context.transpose(1, 2),
                                   alpha=self.mla_scale)  # [B, heads, ctx]
            out = torch.bmm(torch.softmax(scores, dim=-1), context[..., :lora])  # [B, heads, lora]
        else:
            padded = query.new_zeros(B * Lq, heads, lora + rope)
            padded[batch.padded_index] = query
            query = padded.view(B, Lq, heads, lora + rope)
            context = context[:, None]
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), context, context[..., :lora], attn_mask=batch.attn_bias,
                scale=self.mla_scale, enable_gqa=True)  # [B, heads, Lq, lora]
            out = out.transpose(1, 2).reshape(B * Lq, heads, lora)[batch.padded_index]
        out = torch.bmm(out.transpose(0, 1), w.w_uv.transpose(1, 2)).transpose(0, 1)  # [N, heads, v]
        out = out * torch.sigmoid(gate.float()).to(out.dtype).unsqueeze(-1)
        return self.linear(out.reshape(N, heads * cfg.v_head_dim), w.o_proj, w.o_bias)

    def _forget_gate(self, f: torch.Tensor, w: HybridLayerWeights) -> torch.Tensor:
        """Per-channel log-decay (<= 0), float32, [N, heads, head_dim]."""
        cfg = self.cfg
        x = (f.float() + w.dt_bias).view(-1, cfg.kda_heads, cfg.kda_head_dim)
        rate = w.decay_rate.view(1, -1, 1)
        if cfg.kda_safe_gate:
            return cfg.kda_lower_bound * torch.sigmoid(rate * x)
        return -rate * F.softplus(x)

    def kda(self, x, i: int, batch: ForwardBatch, cache: HybridCache, slots: torch.Tensor, runs) -> torch.Tensor:
        cfg, w = self.cfg, self.ckpt.layers[i]
        N, D, h, hd = x.shape[0], self.kda_dim, cfg.kda_heads, cfg.kda_head_dim
        mixed, f, out_gate, b = self.linear(x, w.kda_in_proj).split([3 * D, D, D, h], dim=-1)
        log_decay = self._forget_gate(f, w)
        beta = torch.sigmoid(b.float())
        conv_pool, state_pool = cache.conv[i], cache.recurrent[i]
        K = cfg.conv_kernel
        if batch.max_q == 1 and all(batch.num_cached):  # decode: one token of every sequence at once
            whole = len(runs) == 1 and runs[0][0] == list(range(N))  # the batch's slots are one run, in order
            if whole:  # a view of the pool: no gather, no scatter
                conv_rows = conv_pool[runs[0][1]:runs[0][1] + N]
                window = torch.cat([conv_rows, mixed.unsqueeze(-1)], dim=-1)  # [B, 3D, K]
                conv_rows.copy_(window[..., 1:])
            else:
                window = torch.cat([conv_pool[slots], mixed.unsqueeze(-1)], dim=-1)
                conv_pool.index_copy_(0, slots, window[..., 1:])
            qkv = F.silu((window.float() * w.conv_weight).sum(-1)).to(x.dtype).float()
            q, k, v = (t.view(N, h, hd) for t in qkv.split(D, dim=-1))
            q = l2_normalize(q) * hd ** -0.5
            k = l2_normalize(k)
            if whole:
                first = runs[0][1]
                out = delta_rule_step(q, k, v, log_decay, beta, state_pool[first:first + N])
            else:
                out = torch.empty_like(v)
                for rows, first in runs:
                    idx = torch.tensor(rows, device=x.device)
                    out[idx] = delta_rule_step(q[idx], k[idx], v[idx], log_decay[idx], beta[idx],
                                               state_pool[first:first + len(rows)])
        else:
            outs, start = [], 0
            for b_idx, (q_len, cached) in enumerate(zip(batch.q_lens, batch.num_cached)):
                slot = int(slots[b_idx])
                rows = slice(start, start + q_len)
                start += q_len
                history = conv_pool[slot] if cached else conv_pool.new_zeros(3 * D, K - 1)
                seq = torch.cat([history, mixed[rows].t()], dim=-1)  # [3D, K - 1 + T]
                conv_pool[slot] = seq[:, -(K - 1):]
                conv = F.conv1d(seq.float().unsqueeze(0), w.conv_weight.unsqueeze(1), groups=3 * D)[0].t()
                qkv = F.silu(conv).to(x.dtype).float()
                q, k, v = (t.reshape(q_len, h, hd) for t in qkv.split(D, dim=-1))
                q = l2_normalize(q) * hd ** -0.5
                k = l2_normalize(k)
                state = state_pool[slot] if cached else state_pool.new_zeros(h, hd, hd)
                out_b, state = delta_rule_chunked(q, k, v, log_decay[rows], beta[rows], state)
                state_pool[slot] = state
                outs.append(out_b)
            out = torch.cat(outs)
        # RMSNorm per head, gated by sigmoid(output gate), in float32
        out = rms_norm(out, w.out_norm, cfg.rms_norm_eps) * torch.sigmoid(out_gate.float()).view(N, h, hd)
        return self.linear(out.to(x.dtype).reshape(N, D), w.o_proj)

    def swiglu(self, x, w13, w2):
        gate, up = self.linear(x, w13).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, w2)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: HybridCache, all_positions: bool = False) -> torch.Tensor:
        """Logits of each sequence's last new token, [B, vocab] float32 (every new token with all_positions)."""
        cfg = self.cfg
        h = self.ckpt.embed[batch.input_ids]
        self.moe_block.start(h)
        slots = cache.block_manager.state_slots(batch.context_blocks[:, 0]) if cfg.kda_layers else None
        runs = slot_runs(slots.tolist()) if slots is not None and batch.max_q == 1 else None
        rope_tables = self.rope.tables(batch.positions, h.dtype, batch.max_position) if self.rope else None
        eps = cfg.rms_norm_eps
        for i, w in enumerate(self.ckpt.layers):
            x = rms_norm(h, w.input_norm, eps)
            if w.kind == MLA:
                h = h + self.mla(x, i, batch, cache, rope_tables)
            else:
                h = h + self.kda(x, i, batch, cache, slots, runs)
            x = rms_norm(h, w.post_attention_norm, eps)
            if cfg.is_moe_layer(i):
                # routed + shared first, then the residual: transformers' order of the two additions
                shared = self.swiglu(x, w.shared_w13, w.shared_w2) if w.shared_w13 is not None else None
                h = self.moe_block(i, x, h, shared)
            else:
                h = h + self.swiglu(x, w.dense_w13, w.dense_w2)
        if not all_positions and batch.max_q > 1:
            h = h[batch.last_token_index]
        h = rms_norm(h, self.ckpt.final_norm, eps)
        return self.linear(h, self.ckpt.lm_head).float()


def make_hybrid_cache(ckpt, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype,
                      device: str) -> tuple[StateBlockManager, HybridCache]:
    cfg: HybridModelConfig = ckpt.config
    bm = StateBlockManager(num_blocks, block_size, num_state_slots)
    cache = HybridCache(bm, cfg.mla_layers, cfg.kda_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                        cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel, dtype, device)
    return bm, cache


__all__ = ["HybridModelConfig", "HybridTransformer", "parse_hybrid_config", "load_hybrid_checkpoint",
           "make_hybrid_cache"]
