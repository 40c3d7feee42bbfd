"""The MoE transformer forward (Qwen3-MoE and Mixtral): GQA attention with RoPE over a paged KV
cache, RMSNorm, and an MoE block that routes, asks the expert store for weights, and calls the
configured MoE kernel. Plain tensors, no autograd: the model is only ever run for inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebench.engine import decode_path
from moebench.engine.kv_cache import KVCache
from moebench.engine.loader import Checkpoint
from moebench.engine.runner import ForwardBatch, build_forward_batch  # noqa: F401 (imported from here)
from moebench.kernels import cpu_dense, route
from moebench.engine.overrides import DEFAULT as NO_OVERRIDES
from moebench.engine.overrides import VARIABLES as OVERRIDE_VARIABLES
from moebench.kernels.cpu_attention import paged_decode_attention
from moebench.errors import MoebenchError


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

    def ensure(self, max_position: int) -> None:
        """Grow the tables to hold `max_position`."""
        if max_position >= self.cos.shape[0]:
            self._build(2 * max_position + 1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None):
        """cos and sin rows of `positions`, [N, 1, head_dim]: looked up once per forward, used by
        every layer's q and k."""
        self.ensure(int(positions.max()) if max_position is None else max_position)
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, head_dim]; rotate-half convention, as Hugging Face's Llama-family models."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class MoeTransformer:
    """Forward pass over a `Checkpoint`. `moe_block(layer, x, h)` is injected: it owns routing-to-output
    and returns h + its output.

    On the CPU in float32 the small ops of a step run in the C++ extension (kernels/csrc/
    norms_cpu.cpp, attention_cpu.cpp) where it is built: residual add + RMSNorm in one call, a decode
    step's attention from the qkv projection to the output projection in one call. The router's top-k
    is `kernels.route`'s choice (the extension's on the CPU in float32, routing_cpu.cpp).
    Each computes exactly what the torch ops it replaces compute (tests compare bit for bit):
    softmax stays torch's own, the RMSNorm mean is summed in torch's order. Projections of a decode
    step's few rows (qkv, output, router) go through `kernels.cpu_dense.linear` on both paths: a
    streaming kernel on the step's thread pool (F.linear to float32 rounding); the LM head through
    `cpu_dense.lm_head`, the same kernel, in the precision `lm_head` asks for (docs/lm-head.md)."""

    def __init__(self, ckpt: Checkpoint, moe_block, lm_head: str = "f32", overrides=NO_OVERRIDES):
        from moebench.engine.quantize import lm_head_for

        self.ckpt = ckpt
        self.overrides = overrides
        on_cpu_f32 = ckpt.embed.device.type == "cpu" and ckpt.embed.dtype == torch.float32
        # the dense projections' op, bound once: the streaming kernel for a decode step's rows, or torch
        # everywhere (the dense override)
        dense_kernel = overrides.dense == "kernel"
        self.linear = cpu_dense.linear if dense_kernel else cpu_dense.torch_linear
        self.cfg = ckpt.config
        self.moe_block = moe_block
        self.rope = RotaryEmbedding(self.cfg.head_dim, self.cfg.rope_theta, ckpt.embed.device)
        self.scale = self.cfg.head_dim ** -0.5
        # decode steps read the paged KV cache directly (kernels/cpu_attention.py) where the kernel
        # applies; the attention override keeps the gather + SDPA path
        self.fast_decode_attention = overrides.attention == "kernel"
        # the extension's exact small ops, residual add + RMSNorm and the chains built on them (None:
        # torch ops only, also where the norms override asks for that)
        self.ops = cpu_step_ops() if on_cpu_f32 and overrides.norms == "kernel" else None
        self.moe_layers = [self.cfg.is_moe_layer(i) for i in range(self.cfg.num_layers)]
        # decode attention calls (one per layer and decode step) by the implementation that ran them:
        # the activation evidence of the C++ decode attention (see decode_attention_errors)
        self.attention_backends: dict[str, int] = {}
        # a decode step's attention sub-layer and router each run as one native call where the ops
        # they chain apply (the chains override calls them one by one, for A/B measurements)
        # (the weights a chain streams are checked here, once: they do not change)
        chained_weights = [w for layer in ckpt.layers for w in (layer.qkv_proj, layer.o_proj, layer.router)
                           if w is not None]
        # the LM head in the precision asked for (--lm-head: f32 is the checkpoint's own; bf16, or int8 /
        # fp8 with a scale per row, an approximate optimization) and what the kernel streamed of it so
        # far in this process, the start of this model's activation evidence (lm_head_evidence)
        self.lm_head_dtype = lm_head
        self.head_weight, self.head_scale = lm_head_for(ckpt, lm_head)
        self._head_counts_start = self._head_counts()
        # the other weights' precision (--weights: engine/quantize.py weights_in made the checkpoint) and
        # what the kernels streamed of them from here on (engine/weight_evidence.py)
        from moebench.engine.weight_evidence import WeightsEvidence

        self._weights = WeightsEvidence(getattr(ckpt, "weights", "f32"), ckpt, ckpt.embed.device.type)
        # the native call ends with the LM head where the kernel streams it (its logits are returned);
        # a decode step's rows run the kernel's op, bound here, other rows torch (logits)
        streams = dense_kernel and cpu_dense.head_streams(self.head_weight, self.head_scale)
        self._native_lm_head = streams
        ext = cpu_dense.load_extension() if streams and on_cpu_f32 else None
        self._head_kernel = ext.lm_head_linear if ext is not None else None
        self._head_torch = cpu_dense.lm_head if dense_kernel else cpu_dense.torch_lm_head
        # speculative MTP drafting reads each forward's final-normed hidden states (keep_hidden_states)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.chains_available = (self.ops is not None and hasattr(self.ops, "route_decode") and overrides.chains
                                 and dense_kernel and cpu_dense.dense_kernel_enabled() and self.fast_decode_attention
                                 and all(map(cpu_dense.weight_streams, chained_weights)))
        # whether a decode step's attention sub-layers and routers run as one native call each: set by
        # the session's step runner when it is built (engine/decode_path.py), as is the runner itself;
        # a model alone runs auto's (tests drive one)
        self.decode_chains = False
        self.runner = decode_path.decide(None, self)

    def keep_hidden_states(self) -> None:
        """Have every forward keep all its rows' final-normed hidden states (what the LM head reads)
        in `last_hidden`, for an MTP head (engine/mtp.py). A native decode step then returns them and
        the LM head runs after it (the same kernel, one call more); without this nothing changes."""
        self.keep_hidden = True
        self._native_lm_head = False

    def attention(self, x, layer_idx: int, batch: ForwardBatch, kv: KVCache, rope_tables) -> torch.Tensor:
        cfg, w = self.cfg, self.ckpt.layers[layer_idx]
        N = x.shape[0]
        B, Lq = batch.batch_size, batch.max_q
        qkv = self.linear(x, w.qkv_proj, w.qkv_bias)
        if Lq == 1 and self.fast_decode_attention and self.ops is not None and kv.k[layer_idx].dtype == torch.float32:
            out = self.ops.decode_attention_block(
                qkv, w.q_norm if cfg.qk_norm else None, w.k_norm if cfg.qk_norm else None, cfg.rms_norm_eps,
                self.rope.cos, self.rope.sin, batch.positions, kv.k[layer_idx], kv.v[layer_idx], batch.slot_mapping,
                batch.context_blocks, batch.context_lens, kv.block_size, self.scale, cfg.sliding_window or 0,
                cfg.num_heads)
            self._count_attention("cpp-block")
            return self.linear(out, w.o_proj)
        q, k, v = qkv.split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q = q.view(N, cfg.num_heads, cfg.head_dim)
        k = k.view(N, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(N, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        if rope_tables is None:
            rope_tables = self.rope.tables(batch.positions, x.dtype, batch.max_position)
        q = self.rope.apply(q, *rope_tables)
        k = self.rope.apply(k, *rope_tables)
        kv.k[layer_idx].index_copy_(0, batch.slot_mapping, k)
        kv.v[layer_idx].index_copy_(0, batch.slot_mapping, v)

        if Lq == 1 and self.fast_decode_attention:
            out = paged_decode_attention(q.view(B, cfg.num_heads, cfg.head_dim), kv.k[layer_idx], kv.v[layer_idx],
                                         batch.context_blocks, batch.context_lens, kv.block_size, self.scale,
                                         cfg.sliding_window)
            if out is not None:
                self._count_attention("cpp-paged")
                return self.linear(out.view(B, cfg.num_heads * cfg.head_dim), w.o_proj)
        if Lq == 1:
            self._count_attention("torch-sdpa")
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
        return self.linear(out, w.o_proj)

    def attention_sublayer(self, h, x, layer_idx: int, batch: ForwardBatch, kv: KVCache, rope_tables,
                           post_norm: torch.Tensor, chained: bool) -> torch.Tensor:
        """h += attention(x) in place; returns RMSNorm(h) with `post_norm` (the extension's ops). A
        `chained` decode step runs it as one native call, the same kernels in the same order as below."""
        cfg, w = self.cfg, self.ckpt.layers[layer_idx]
        if chained:
            self._count_attention("cpp-block")
            return self.ops.decode_attention_sublayer(
                h, x, w.qkv_proj, w.qkv_bias, w.q_norm if cfg.qk_norm else None, w.k_norm if cfg.qk_norm else None,
                cfg.rms_norm_eps, self.rope.cos, self.rope.sin, batch.positions, kv.k[layer_idx], kv.v[layer_idx],
                batch.slot_mapping, batch.context_blocks, batch.context_lens, kv.block_size, self.scale,
                cfg.sliding_window or 0, cfg.num_heads, w.o_proj, post_norm)
        return self.ops.add_rms_norm(h, self.attention(x, layer_idx, batch, kv, rope_tables), post_norm,
                                     cfg.rms_norm_eps)

    def _count_attention(self, backend: str, calls: int = 1) -> None:
        self.attention_backends[backend] = self.attention_backends.get(backend, 0) + calls

    def native_decode_layers(self, experts: dict):
        """The extension's DecodeLayers over this model's weights and `experts` (layer -> (w13, w2), the
        resident store's: MoeBlock.resident_experts), a decode step's layers in one call, and whether
        the LM head runs inside it (its logits are then what the call returns). Built once, by the
        `native` step runner (engine/decode_path.py checked that it applies)."""
        cfg, layers = self.cfg, self.ckpt.layers
        optional = (lambda w: w) if cfg.qk_norm else (lambda w: None)
        head = self._native_lm_head
        native = self.ops.DecodeLayers(
            [w.qkv_proj for w in layers], [w.qkv_bias for w in layers], [optional(w.q_norm) for w in layers],
            [optional(w.k_norm) for w in layers], [w.o_proj for w in layers],
            [w.post_attention_norm for w in layers], [w.router for w in layers], [experts[i][0] for i in range(len(layers))],
            [experts[i][1] for i in range(len(layers))], [w.input_norm for w in layers[1:]] + [self.ckpt.final_norm],
            cfg.rms_norm_eps, self.scale, cfg.sliding_window or 0, cfg.num_heads, cfg.top_k, cfg.norm_topk_prob,
            self.ckpt.embed.contiguous(), layers[0].input_norm, self.head_weight if head else None,
            self.head_scale if head else None)
        return native, bool(head)

    def dense_mlp(self, x, layer_idx: int) -> torch.Tensor:
        w = self.ckpt.layers[layer_idx]
        gate, up = self.linear(x, w.dense_w13).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, w.dense_w2)

    def route(self, x, layer_idx: int):
        cfg, router = self.cfg, self.ckpt.layers[layer_idx].router
        if self.decode_chains and x.shape[0] <= cpu_dense.DENSE_MAX_ROWS:  # (float32 CPU rows: chains are)
            return self.ops.route_decode(x.contiguous(), router, cfg.top_k, cfg.norm_topk_prob)
        weights, ids = route(self.linear(x, router), cfg.top_k, cfg.norm_topk_prob)
        return weights.to(x.dtype), ids

    def forward(self, batch: ForwardBatch, kv: KVCache, all_positions: bool = False) -> torch.Tensor:
        """Logits of each sequence's last new token, [B, vocab] float32 (every new token with all_positions),
        as the session's step runner runs them (engine/runner.py)."""
        return self.runner.run(batch, kv, all_positions)

    def forward_torch(self, batch: ForwardBatch, kv: KVCache, all_positions: bool, chained: bool = False) -> torch.Tensor:
        """The layer loop in torch ops (no extension, or not float32 on the CPU). The MoE block adds
        its output to the residual stream itself (its prefetcher reads the stream)."""
        cfg = self.cfg
        h = self.ckpt.embed[batch.input_ids]
        self.moe_block.start(h)
        # every sequence has one new token in a decode step: it is already its last one
        select = not all_positions and batch.max_q > 1
        rope_tables = self.rope.tables(batch.positions, h.dtype, batch.max_position)
        for i, w in enumerate(self.ckpt.layers):
            h = h + self.attention(rms_norm(h, w.input_norm, cfg.rms_norm_eps), i, batch, kv, rope_tables)
            x = rms_norm(h, w.post_attention_norm, cfg.rms_norm_eps)
            h = self.moe_block(i, x, h) if cfg.is_moe_layer(i) else h + self.dense_mlp(x, i)
        if self.keep_hidden:  # rows are normalized alone: norming all of them first changes none
            h = self.last_hidden = rms_norm(h, self.ckpt.final_norm, cfg.rms_norm_eps)
            return self.logits(h[batch.last_token_index] if select else h)
        if select:
            h = h[batch.last_token_index]
        h = rms_norm(h, self.ckpt.final_norm, cfg.rms_norm_eps)
        return self.logits(h)

    def forward_layers(self, batch: ForwardBatch, kv: KVCache, all_positions: bool, chained: bool) -> torch.Tensor:
        """`forward_torch` with the extension's exact small ops: residual add + RMSNorm in one call,
        which adds into h in place (h is this forward's own tensor, and whoever read it before, the
        prefetcher, is done with it), and a decode step's attention in one call; `chained` (a decode
        step the runner chains) runs each attention sub-layer as one call too. The final norm runs on
        every row before the last tokens are picked: rows are normalized alone."""
        cfg = self.cfg
        h = self.ckpt.embed[batch.input_ids]
        self.moe_block.start(h)
        select = not all_positions and batch.max_q > 1
        add_norm, eps, layers, moe = self.ops.add_rms_norm, cfg.rms_norm_eps, self.ckpt.layers, self.moe_layers
        self.rope.ensure(batch.max_position)
        # decode attention reads the whole cos/sin tables in C++; other steps look their rows up once
        decode_block = batch.max_q == 1 and self.fast_decode_attention
        rope_tables = None if decode_block else self.rope.tables(batch.positions, h.dtype, batch.max_position)
        x = add_norm(h, None, layers[0].input_norm, eps)
        for i, w in enumerate(layers):
            x = self.attention_sublayer(h, x, i, batch, kv, rope_tables, w.post_attention_norm, chained)
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.ckpt.final_norm
            if moe[i]:
                h = self.moe_block(i, x, h)
                x = add_norm(h, None, next_norm, eps)
            else:
                x = add_norm(h, self.dense_mlp(x, i), next_norm, eps)
        if self.keep_hidden:
            self.last_hidden = x
        if select:
            x = x[batch.last_token_index]
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on the final norm's output: [rows, vocab] float32: a decode step's rows in the
        kernel bound when the model was made, others in torch (kernels/cpu_dense.lm_head)."""
        if self._head_kernel is not None and x.shape[0] <= cpu_dense.DENSE_MAX_ROWS:
            return self._head_kernel(x if x.stride(-1) == 1 else x.contiguous(), self.head_weight, self.head_scale)
        return self._head_torch(x, self.head_weight, self.head_scale)

    def _head_counts(self) -> dict:
        # the extension's counters where this model's steps may use it (a CPU model); a CUDA model's
        # head runs in torch and only the torch counts apply
        if self.ckpt.embed.device.type == "cpu":
            return cpu_dense.lm_head_stats()
        return {"kernel": {}, "torch": cpu_dense.lm_head_stats_torch()}

    def lm_head_evidence(self) -> dict:
        """The LM head's precision asked for, and what ran since this model was built: per weight
        dtype, the calls and bytes the extension's kernel streamed ("kernel", counted there), and the
        calls that ran in torch ("torch"). Counters are per process: one engine runs at a time."""
        now, start = self._head_counts(), self._head_counts_start
        kernel = {}
        for dtype, c in now["kernel"].items():
            before = start["kernel"].get(dtype, {"calls": 0, "bytes": 0})
            if c["calls"] > before["calls"]:
                kernel[dtype] = {"calls": c["calls"] - before["calls"], "bytes": c["bytes"] - before["bytes"]}
        torch_calls = {d: n - start["torch"].get(d, 0) for d, n in now["torch"].items() if n > start["torch"].get(d, 0)}
        return {"precision": self.lm_head_dtype, "stored_dtype": str(self.head_weight.dtype).replace("torch.", ""),
                "kernel": kernel, "torch": torch_calls}


    def weights_evidence(self) -> dict:
        """--weights: the precision, the dtypes held, and what the kernels streamed since this model was
        built, by kind (dense, experts) and weight dtype (engine/weight_evidence.py)."""
        return self._weights.evidence()


STEP_OPS = ("add_rms_norm", "decode_attention_block")


def decode_attention_errors(backends: dict | None, device: str, dtype: torch.dtype, overrides=NO_OVERRIDES) -> list[str]:
    """Decode attention on the CPU in float32 is the C++ kernel's; a decode call the torch path ran
    there fell back (the extension did not build), which is an activation failure unless the user
    chose it (the attention override) or accepts fallbacks (the allow_fallback override)."""
    fell_back = (backends or {}).get("torch-sdpa", 0)
    if not fell_back or device != "cpu" or dtype != torch.float32 or overrides.allow_fallback:
        return []
    if overrides.attention == "torch":
        return []
    variable = OVERRIDE_VARIABLES["attention"]
    return [f"decode attention fell back to torch SDPA in {fell_back} of {sum(backends.values())} calls: the C++ "
            f"kernel did not run (set {variable}=torch to accept that)"]


STORED_DTYPES = {"f32": "float32", "bf16": "bfloat16", "int8": "int8", "fp8": "float8_e4m3fn"}


def lm_head_errors(evidence: dict | None, device: str, overrides=NO_OVERRIDES) -> list[str]:
    """A low-precision LM head must be seen where it ran: on the CPU the kernel must have streamed
    its rows in the stored dtype, and never float32 (that is the full-precision head: the option did
    nothing); elsewhere (CUDA) torch must have run it in the stored dtype. A CPU head that ran only in
    torch (no extension) is an error unless fallbacks are accepted or the user switched the dense
    kernel off (the allow_fallback and dense overrides)."""
    precision = (evidence or {}).get("precision", "f32")
    if precision == "f32":
        return []
    want = STORED_DTYPES[precision]
    kernel, in_torch = evidence.get("kernel") or {}, evidence.get("torch") or {}
    errors = []
    if "float32" in kernel:
        errors.append(f"--lm-head {precision}: the LM-head kernel streamed float32 in {kernel['float32']['calls']} "
                      f"calls ({kernel['float32']['bytes']} bytes): the full-precision head ran")
    if want not in kernel:
        chose_torch = overrides.dense == "torch"
        if device != "cpu" or overrides.allow_fallback or chose_torch:
            if want not in in_torch:
                errors.append(f"--lm-head {precision}: no LM-head call ran with {want} weights")
        else:
            errors.append(f"--lm-head {precision}: the LM-head kernel never streamed {want} weights "
                          f"(calls in torch: {in_torch or 'none'})")
    return errors


def cpu_step_ops():
    """The C++ extension when it is built and has the exact small ops, else None."""
    from moebench.kernels.cpu_moe import load_extension

    ext = load_extension()
    return ext if ext is not None and all(hasattr(ext, name) for name in STEP_OPS) else None
