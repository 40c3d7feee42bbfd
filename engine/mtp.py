"""Multi-token-prediction (MTP, "NextN") heads: their weights, their forward, and the drafter that
chains them (`--speculative mtp`, engine/speculative.py).

A DeepSeek-V3-style checkpoint says `num_nextn_predict_layers: N` in config.json and stores MTP
module i under `model.layers.{num_hidden_layers + i}.`: `enorm` and `hnorm` (RMSNorms of the next
token's embedding and of the main model's hidden state), `eh_proj` ([H, 2H], applied to the two
normed vectors concatenated, embedding first), one decoder block in the main model's own layout
(`input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `mlp.*`, dense or routed experts),
and `shared_head.norm`. The embedding and the LM head are the main model's (`shared_head.head` and
`embed_tokens`, where a checkpoint repeats them there, are the same tensors and are not read).

At position p the module reads h_p, the main model's final-normed hidden state (what its LM head
reads), and the token x_{p+1}, and predicts x_{p+2}:
    x = eh_proj([enorm(embed(x_{p+1})), hnorm(h_p)]);  x += attn(x);  x += mlp(x);  out = norm(x)
with the block's attention over the module's own K/V of positions 0..p. Those K/V live in a one-layer
paged cache that shares the main cache's block tables (position p's K/V in the same slot), so the
block manager's allocation, rollback and preemption cover them with nothing more to track.

Only the first module is used (DeepSeek-V3 ships one); K > 1 drafts chain it on its own outputs, as
SGLang's NEXTN steps do: draft j + 1 is the head at position p + j fed its own output state and
draft j. Drafts are the head's argmax, a point mass, so engine/speculative.py's acceptance rule
stays exact (greedy and sampled outputs are plain decoding's).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moebench.engine.kv_cache import KVCache
from moebench.engine.loader import LayerWeights, TensorIndex, _expert_names
from moebench.errors import MoebenchError
from moebench.kernels.cpu_attention import paged_decode_attention, paged_decode_attention_reference
from moebench.kernels import cpu_dense, route
from moebench.kernels.reference import moe_reference

CONFIG_FIELD = "num_nextn_predict_layers"  # DeepSeek-V3's (transformers' and SGLang's name for it)


@dataclass
class MtpWeights:
    layer_index: int  # where the module sits in the checkpoint: model.layers.{layer_index}
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [H, 2H]: columns 0..H-1 read the normed embedding, H..2H-1 the normed hidden state
    head_norm: torch.Tensor  # shared_head.norm
    block: LayerWeights  # dense MLP (dense_w13 / dense_w2) or routed experts (router / w13 / w2)

    @property
    def num_params(self) -> int:
        block = sum(v.numel() for k, v in vars(self.block).items()
                    if isinstance(v, torch.Tensor) and k not in ("qkv_proj", "qkv_bias"))
        return block + sum(t.numel() for t in (self.enorm, self.hnorm, self.eh_proj, self.head_norm))


def mtp_layer_count(path: Path) -> int:
    raw = json.loads((Path(path) / "config.json").read_text())
    return int(raw.get(CONFIG_FIELD) or 0)


def load_mtp(ckpt) -> MtpWeights:
    """The checkpoint's first MTP module in float32 on the checkpoint's device; a checkpoint without
    one is a one-line error."""
    cfg, path = ckpt.config, Path(ckpt.path)
    if cfg.family not in ("qwen3_moe", "mixtral"):
        raise MoebenchError(f"--speculative mtp: MTP heads are read for qwen3_moe and mixtral checkpoints, not {cfg.family}")
    if mtp_layer_count(path) < 1:
        raise MoebenchError(f"--speculative mtp: {path} has no multi-token-prediction layers "
                            f"(config.json {CONFIG_FIELD} is 0 or absent)")
    try:
        return _read_mtp(ckpt, TensorIndex(path))
    except MoebenchError as e:
        raise MoebenchError(f"--speculative mtp: {e}") from None


def _read_mtp(ckpt, index: TensorIndex) -> MtpWeights:
    cfg = ckpt.config
    device, dtype = ckpt.embed.device, ckpt.embed.dtype
    L, H, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    p = f"model.layers.{L}"

    def get(name: str, *shape: int) -> torch.Tensor:
        return index.get(f"{p}.{name}", shape).to(device=device, dtype=dtype)

    def matrix(name: str, *shape: int) -> torch.Tensor:
        # held as the main model holds its dense matrices (Checkpoint.dense_dtype: a bfloat16 file's
        # own bfloat16 where the CPU kernels stream it, widened in registers): the same values as
        # the float32 copy at half the bytes a draft reads
        return index.get(f"{p}.{name}", shape).to(device=device, dtype=ckpt.dense_dtype)

    def shape_of(name: str) -> tuple[int, ...]:
        full = f"{p}.{name}"
        return tuple(index._open(index.file_of(full)).get_slice(full).get_shape())

    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    block = LayerWeights(
        input_norm=get("input_layernorm.weight", H), post_attention_norm=get("post_attention_layernorm.weight", H),
        q_proj=matrix("self_attn.q_proj.weight", q_out, H), k_proj=matrix("self_attn.k_proj.weight", kv_out, H),
        v_proj=matrix("self_attn.v_proj.weight", kv_out, H), o_proj=matrix("self_attn.o_proj.weight", H, q_out))
    if cfg.attention_bias:
        block.q_bias = get("self_attn.q_proj.bias", q_out)
        block.k_bias = get("self_attn.k_proj.bias", kv_out)
        block.v_bias = get("self_attn.v_proj.bias", kv_out)
    if cfg.qk_norm:
        block.q_norm, block.k_norm = get("self_attn.q_norm.weight", hd), get("self_attn.k_norm.weight", hd)
    router = "block_sparse_moe.gate.weight" if cfg.family == "mixtral" else "mlp.gate.weight"
    if f"{p}.{router}" in index:  # routed experts, as the main model's MoE layers
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        block.router = get(router, E, H)
        names = [_expert_names(cfg, L, e) for e in range(E)]
        strip = len(p) + 1
        block.w13 = torch.stack([torch.cat([get(g[strip:], I, H), get(u[strip:], I, H)]) for g, u, _ in names])
        block.w2 = torch.stack([get(d[strip:], H, I) for _, _, d in names])
    else:  # a dense SwiGLU MLP (the bundled model's head), its width read from the file
        D = shape_of("mlp.gate_proj.weight")[0]
        block.dense_w13 = torch.cat([matrix("mlp.gate_proj.weight", D, H), matrix("mlp.up_proj.weight", D, H)])
        block.dense_w2 = matrix("mlp.down_proj.weight", H, D)
    block.stack_qkv()
    return MtpWeights(L, get("enorm.weight", H), get("hnorm.weight", H), matrix("eh_proj.weight", H, 2 * H),
                      get("shared_head.norm.weight", H), block)


def make_mtp_drafter(ckpt, model, num_kv_blocks: int, block_size: int) -> "MtpDrafter":
    """The checkpoint's MTP head (read once per checkpoint) as a drafter over a cache of
    `num_kv_blocks` beside the model's; the model keeps each step's hidden states from now on."""
    if ckpt.mtp_weights is None:
        ckpt.mtp_weights = load_mtp(ckpt)
    model.keep_hidden_states()
    return MtpDrafter(ckpt.mtp_weights, model, num_kv_blocks, block_size)


class MtpHead:
    """The MTP module's forward over one-token rows, each at its own position with its own context
    (as speculative verify rows are), over a one-layer paged cache sharing the main block tables."""

    def __init__(self, weights: MtpWeights, model, num_kv_blocks: int, block_size: int):
        cfg = model.cfg
        self.w, self.model, self.cfg = weights, model, cfg
        self.kv = KVCache(1, num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.ckpt.embed.dtype,
                          model.ckpt.embed.device)
        self.attention_backends: dict[str, int] = {}
        self._native = None  # the block as the extension's DecodeLayers (False: not here), see _native_block
        self._rows = None  # the row buffer DecodeLayers reads its input from, as its "embedding table"

    def _native_block(self, rows: int):
        """The block (attention, MLP, the head's norm) as one call of the extension's DecodeLayers,
        the main model's native decode step, over a one-layer model: a dense MLP is one expert that
        every row routes to with weight 1 (softmax over one logit), a routed one is itself. Its
        "embedding table" is a buffer of rows holding eh_proj's output, read by row index. None
        where it does not apply (no extension or chains, few rows only)."""
        model, b, cfg = self.model, self.w.block, self.cfg
        if self._native is None:
            self._native = False
            ok = (model.ops is not None and hasattr(model.ops, "DecodeLayers") and model.decode_chains
                  and self.kv.k[0].dtype == torch.float32
                  and all(cpu_dense.weight_streams(t) for t in (b.qkv_proj, b.o_proj)))
            if ok:
                if b.router is not None:
                    router, w13, w2, top_k, renorm = b.router, b.w13, b.w2, cfg.top_k, cfg.norm_topk_prob
                else:
                    router = torch.zeros(1, cfg.hidden_size, dtype=torch.float32)
                    w13, w2, top_k, renorm = b.dense_w13[None].contiguous(), b.dense_w2[None].contiguous(), 1, True
                self._rows = torch.zeros(cpu_dense.DENSE_MAX_ROWS, cfg.hidden_size, dtype=torch.float32)
                optional = (lambda t: t) if cfg.qk_norm else (lambda t: None)
                self._native = model.ops.DecodeLayers(
                    [b.qkv_proj], [b.qkv_bias], [optional(b.q_norm)], [optional(b.k_norm)], [b.o_proj],
                    [b.post_attention_norm], [router], [w13], [w2], [self.w.head_norm], cfg.rms_norm_eps, model.scale,
                    cfg.sliding_window or 0, cfg.num_heads, top_k, renorm, self._rows, b.input_norm, None, None)
                self._row_ids = torch.arange(cpu_dense.DENSE_MAX_ROWS)
        return self._native if self._native and rows <= cpu_dense.DENSE_MAX_ROWS else None

    def forward(self, tokens: list[int], hidden: torch.Tensor, positions: list[int], tables: list[list[int]]):
        """Rows (token x_{p+1}, hidden h_p, position p, block table) -> (output states [N, H], logits
        [N, vocab] float32). Every row's K/V is written before any row attends. On the CPU in
        float32 the norms, residual adds and (for few rows) the attention sub-layer run as the
        extension's ops, the ones the main model's decode step runs."""
        from moebench.engine.model import build_forward_batch, rms_norm

        cfg, w, b, model = self.cfg, self.w, self.w.block, self.model
        eps = cfg.rms_norm_eps
        embed = model.ckpt.embed
        batch = build_forward_batch([[t] for t in tokens], positions, tables, self.kv.block_size,
                                    embed.device.type, cfg.sliding_window, embed.dtype)
        model.rope.ensure(batch.max_position)
        ops = model.ops if hidden.dtype == torch.float32 and hidden.device.type == "cpu" else None
        if ops is None:
            x = self.model.linear(torch.cat([rms_norm(embed[batch.input_ids], w.enorm, eps), rms_norm(hidden, w.hnorm, eps)],
                                 dim=-1), w.eh_proj)
            x = x + self._attention(rms_norm(x, b.input_norm, eps), batch)
            x = x + self._mlp(rms_norm(x, b.post_attention_norm, eps))
            out = rms_norm(x, w.head_norm, eps)
            return out, model.logits(out)
        # the same math; add_rms_norm(h, d, w) adds d into h in place and returns RMSNorm(h) (F.rms_norm
        # alone costs ~0.2 ms a call on a few rows here)
        e = ops.add_rms_norm(embed[batch.input_ids], None, w.enorm, eps)
        x = self.model.linear(torch.cat([e, ops.add_rms_norm(hidden.contiguous(), None, w.hnorm, eps)], dim=-1), w.eh_proj)
        native = self._native_block(len(tokens))
        if native is not None:
            n = len(tokens)
            self._rows[:n].copy_(x)
            out = native.run(self._row_ids[:n], model.rope.cos, model.rope.sin, batch.positions, batch.slot_mapping,
                             batch.context_blocks, batch.context_lens, self.kv.block_size, self.kv.k, self.kv.v)[0]
            self._count("cpp-native-block")
            return out, model.logits(out)
        normed = ops.add_rms_norm(x, None, b.input_norm, eps)
        if model.decode_chains and cpu_dense.rows_stream(normed) and cpu_dense.weight_streams(b.qkv_proj):
            self._count("cpp-sublayer")  # x += attention(normed) in one call, then its post-attention norm
            h = ops.decode_attention_sublayer(
                x, normed, b.qkv_proj, b.qkv_bias, b.q_norm if cfg.qk_norm else None, b.k_norm if cfg.qk_norm else None,
                eps, model.rope.cos, model.rope.sin, batch.positions, self.kv.k[0], self.kv.v[0], batch.slot_mapping,
                batch.context_blocks, batch.context_lens, self.kv.block_size, model.scale, cfg.sliding_window or 0,
                cfg.num_heads, b.o_proj, b.post_attention_norm)
        else:
            h = ops.add_rms_norm(x, self._attention(normed, batch), b.post_attention_norm, eps)
        out = ops.add_rms_norm(x, self._mlp(h), w.head_norm, eps)
        return out, model.logits(out)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        b, cfg = self.w.block, self.cfg
        if b.router is not None:
            weights, ids = route(self.model.linear(h, b.router), cfg.top_k, cfg.norm_topk_prob)
            return moe_reference(h, weights.to(h.dtype), ids, b.w13, b.w2)
        gate, up = self.model.linear(h, b.dense_w13).chunk(2, dim=-1)
        return self.model.linear(F.silu(gate) * up, b.dense_w2)

    def _attention(self, x: torch.Tensor, batch) -> torch.Tensor:
        cfg, b, model = self.cfg, self.w.block, self.model
        k_pool, v_pool = self.kv.k[0], self.kv.v[0]
        qkv = self.model.linear(x, b.qkv_proj, b.qkv_bias)
        model.rope.ensure(batch.max_position)
        if model.ops is not None and model.fast_decode_attention and k_pool.dtype == torch.float32:
            out = model.ops.decode_attention_block(
                qkv, b.q_norm if cfg.qk_norm else None, b.k_norm if cfg.qk_norm else None, cfg.rms_norm_eps,
                model.rope.cos, model.rope.sin, batch.positions, k_pool, v_pool, batch.slot_mapping,
                batch.context_blocks, batch.context_lens, self.kv.block_size, model.scale, cfg.sliding_window or 0,
                cfg.num_heads)
            self._count("cpp-block")
            return self.model.linear(out, b.o_proj)
        from moebench.engine.model import RotaryEmbedding, rms_norm

        N, hd = x.shape[0], cfg.head_dim
        q, k, v = qkv.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], dim=-1)
        q, k, v = q.view(N, cfg.num_heads, hd), k.view(N, cfg.num_kv_heads, hd), v.reshape(N, cfg.num_kv_heads, hd)
        if cfg.qk_norm:
            q, k = rms_norm(q, b.q_norm, cfg.rms_norm_eps), rms_norm(k, b.k_norm, cfg.rms_norm_eps)
        tables = model.rope.tables(batch.positions, x.dtype, batch.max_position)
        q, k = RotaryEmbedding.apply(q, *tables), RotaryEmbedding.apply(k, *tables)
        k_pool.index_copy_(0, batch.slot_mapping, k)
        v_pool.index_copy_(0, batch.slot_mapping, v)
        args = (q, k_pool, v_pool, batch.context_blocks, batch.context_lens, self.kv.block_size, model.scale,
                cfg.sliding_window)
        out = paged_decode_attention(*args)
        self._count("cpp-paged" if out is not None else "torch")
        if out is None:
            out = paged_decode_attention_reference(*args)
        return self.model.linear(out.reshape(N, cfg.num_heads * hd), b.o_proj)

    def _count(self, backend: str) -> None:
        self.attention_backends[backend] = self.attention_backends.get(backend, 0) + 1


class MtpDrafter:
    """Drafting with an MTP head. After each step the engine hands over the hidden states of the
    positions each sequence kept (`observe`); at the next step's plan (`propose`) one head forward
    runs over all of them (writing the head's K/V of those positions with the true hidden states,
    over whatever the previous chain wrote there), its last row per drafting sequence gives draft 1,
    and K - 1 more forwards chain the head on its own outputs."""

    name = "mtp"
    wants_hidden = True

    def __init__(self, weights: MtpWeights, model, num_kv_blocks: int, block_size: int):
        self.head = MtpHead(weights, model, num_kv_blocks, block_size)
        self._pending: dict[int, tuple] = {}  # id(seq) -> (seq, first position, hidden rows [n, H])
        self.forwards = 0
        self.rows = 0  # head rows run: positions caught up plus chained drafts
        self.chained_rows = 0
        self.seconds = 0.0  # wall time of proposing (the head's forwards and their bookkeeping)

    def observe(self, seqs, starts: list[int], kept: list[int], hidden: torch.Tensor | None, offsets: list[int]) -> None:
        """The step's kept positions per sequence: rows offsets[i] .. offsets[i] + kept[i] of the
        step's hidden states, positions starts[i] .. starts[i] + kept[i] - 1."""
        if hidden is None:
            raise MoebenchError("--speculative mtp: the step's forward kept no hidden states")
        idx, spans = [], []
        for seq, start, n, off in zip(seqs, starts, kept, offsets):
            if seq.finished or n <= 0:
                self._pending.pop(id(seq), None)
                continue
            prior = self._pending.get(id(seq))
            if prior is not None and prior[0] is seq and prior[1] + prior[2].shape[0] == start:
                # positions not yet caught up (the sequence was not in a step's plan since): keep them
                spans.append((seq, prior[1], prior[2], len(idx), n))
            else:
                spans.append((seq, start, None, len(idx), n))
            idx.extend(range(off, off + n))
        rows = hidden.index_select(0, torch.tensor(idx, device=hidden.device)) if idx else None
        for seq, start, before, at, n in spans:
            mine = rows[at:at + n]
            self._pending[id(seq)] = (seq, start, mine if before is None else torch.cat([before, mine]))

    def propose(self, seqs, limits: list[int], block_manager) -> tuple[list[list[int]], int]:
        """Each sequence's drafts (up to limits[i]; 0: none, its positions are still caught up) and
        the number of drafts cut for lack of KV room."""
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in seqs]
        tokens, hidden, positions, tables, last = [], [], [], [], {}
        no_room = 0
        for i, seq in enumerate(seqs):
            entry = self._pending.pop(id(seq), None)
            if entry is None or entry[0] is not seq:
                continue
            _, start, rows = entry
            n = rows.shape[0]
            if start + n > seq.num_cached:  # preempted since (its cache is recomputed from position 0)
                continue
            ids = seq.prompt_ids + seq.output_ids if start + n >= len(seq.prompt_ids) else seq.prompt_ids
            tokens.extend(ids[start + 1:start + n + 1])
            hidden.append(rows)
            positions.extend(range(start, start + n))
            tables.extend([seq.block_table] * n)
            # the head drafts where its last row is the newest token's predecessor, in decoding
            if limits[i] > 0 and start + n == seq.num_cached == seq.num_tokens - 1:
                last[i] = len(tokens) - 1
        for seq in list(self._pending.values()):  # finished or aborted outside a step's view
            if seq[0].finished:
                del self._pending[id(seq[0])]
        if not tokens:
            self.seconds += time.perf_counter() - t0
            return drafts, 0
        out, logits = self.head.forward(tokens, torch.cat(hidden), positions, tables)
        self.forwards += 1
        self.rows += len(tokens)
        if last:
            at = list(last.values())
            picks = logits[at].argmax(-1).tolist()
            states = out[at]
            active = []
            for (i, _), tok in zip(last.items(), picks):
                drafts[i].append(tok)
                seq = seqs[i]
                # the chain's row j sits at position num_cached + j - 1: room for num_cached + limit - 1 tokens
                limit = limits[i]
                while limit > 1 and not block_manager.can_fit(seq.block_table, seq.num_cached + limit - 1):
                    limit -= 1
                    no_room += 1
                limits[i] = limit
                if limit > 1:
                    block_manager.ensure_capacity(seq.block_table, seq.num_cached + limit - 1)
                active.append(i)
            for j in range(1, max(limits[i] for i in active)):
                keep = [a for a, i in enumerate(active) if limits[i] > j]
                active = [active[a] for a in keep]
                states = states[keep]
                toks = [drafts[i][-1] for i in active]
                pos = [seqs[i].num_cached + j - 1 for i in active]
                states, logits = self.head.forward(toks, states, pos, [seqs[i].block_table for i in active])
                self.forwards += 1
                self.rows += len(active)
                self.chained_rows += len(active)
                for i, tok in zip(active, logits.argmax(-1).tolist()):
                    drafts[i].append(tok)
        self.seconds += time.perf_counter() - t0
        return drafts, no_room

    def evidence(self) -> dict:
        return {"drafter": "mtp", "head_layer": self.head.w.layer_index, "head_params": self.head.w.num_params,
                "head_matrices_dtype": str(self.head.w.eh_proj.dtype).replace("torch.", ""),
                "head_forwards": self.forwards, "head_rows": self.rows, "head_chained_rows": self.chained_rows,
                "draft_s": round(self.seconds, 6), "head_attention": dict(self.head.attention_backends)}
