"""A session's step runner: the step's inputs as tensors (ForwardBatch) and the forward that runs
them, on the decode path engine/decode_path.py chose when the session started.

A runner is built once per session and holds what it runs with: the model's layer loop or the
extension's DecodeLayers, the step's thread context, and its counters. Nothing is chosen again per
call but what the batch itself fixes (prefill or decode, how many rows). A decode step a runner
cannot run its own way (more rows than the step ops stream) runs the ops one by one and is counted
under its own name, so the evidence says what ran, batch by batch:

- `eager`: every op called from Python, torch keeping its threads.
- `chained`: a decode step's attention sub-layer and router each one native call, layer by layer,
  the MoE op called from Python between them, the parallel work on the step's thread pool.
- `native`: every layer of a decode step, from the token ids to the logits, in one native call
  (DecodeLayers) whose MoE op is the fused kernel on resident experts.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import cached_property

import torch

# A step of more rows than this has enough arithmetic per weight for MKL's blocked GEMM; the step ops
# stream weights for decode-sized batches (kernels/cpu_dense.py DENSE_MAX_ROWS, the same number).
STEP_OP_MAX_ROWS = 32

# decode steps by how their layers ran (the evidence's `decode_steps`)
NATIVE = "native-layers"
LAYER_BY_LAYER = "layer-by-layer"
OVER_ROWS = f"layer-by-layer, ops one by one (over {STEP_OP_MAX_ROWS} rows)"
TORCH = "torch-ops"


@dataclass
class ForwardBatch:
    """Flattened new tokens of every sequence in a step, plus the block view attention reads."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    batch_size: int
    max_q: int
    context_blocks: torch.Tensor  # [B, max_blocks] KV blocks of each sequence's context, in order
    context_lens: torch.Tensor  # [B] context length of each sequence, this step's tokens included
    num_cached: list[int]  # tokens of each sequence already in the cache before this step
    q_lens: list[int]  # new tokens of each sequence
    max_position: int  # the largest position in `positions`
    block_size: int
    sliding_window: int | None
    dtype: torch.dtype

    @cached_property
    def padded_index(self) -> torch.Tensor:
        """[N] position of each token in the [B * max_q] padded layout (prefill attention only)."""
        padded = []
        for b, q in enumerate(self.q_lens):
            padded.extend(range(b * self.max_q, b * self.max_q + q))
        return torch.tensor(padded, device=self.input_ids.device)

    @cached_property
    def last_token_index(self) -> torch.Tensor:
        """[B] index into N of each sequence's last new token."""
        return (torch.tensor(self.q_lens).cumsum(0) - 1).to(self.input_ids.device)

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
    """Index tensors of one step. Built from flat Python lists and one tensor for all of them
    (the fields are views of it), so the cost per sequence is list work, not tensor calls."""
    q_lens = [len(t) for t in new_tokens]
    B, max_q = len(new_tokens), max(q_lens)
    num_cached = list(num_cached)
    if max_q == 1:  # decode: one token per sequence, at position num_cached
        input_ids = [t[0] for t in new_tokens]
        positions = num_cached
        ctx_lens = [c + 1 for c in num_cached]
        slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, num_cached)]
    else:
        input_ids, positions, slots = [], [], []
        ctx_lens = [c + q for c, q in zip(num_cached, q_lens)]
        for tokens, cached, table, ctx in zip(new_tokens, num_cached, block_tables, ctx_lens):
            input_ids.extend(tokens)
            positions.extend(range(cached, ctx))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(cached, ctx))
    max_ctx = max(ctx_lens)
    max_blocks = -(-max_ctx // block_size)
    blocks = []
    for table, ctx in zip(block_tables, ctx_lens):
        used = table[: -(-ctx // block_size)]
        # Padding repeats a block of the sequence's own: any valid id does, the bias masks it out.
        blocks.extend(used)
        blocks.extend(used[:1] * (max_blocks - len(used)))
    N = len(input_ids)
    # one int64 buffer (array -> tensor is a copy of machine ints, unlike torch.tensor's per-item
    # parsing of a list), split into views
    flat = torch.frombuffer(array("q", input_ids + positions + slots + ctx_lens + blocks), dtype=torch.int64)
    if device != "cpu":  # (a call less per step on the CPU, where a small torch call costs ~10 us or more)
        flat = flat.to(device)
    input_ids_t, positions_t, slots_t, ctx_t, blocks_t = flat.split_with_sizes([N, N, N, B, B * max_blocks])
    return ForwardBatch(
        input_ids=input_ids_t, positions=positions_t, slot_mapping=slots_t, batch_size=B, max_q=max_q,
        context_blocks=blocks_t.view(B, max_blocks), context_lens=ctx_t, num_cached=num_cached, q_lens=q_lens,
        max_position=max_ctx - 1, block_size=block_size, sliding_window=sliding_window, dtype=dtype,
    )


@dataclass
class StepPlan:
    """A step's sequences as its forward runs them: each one's new tokens and whether it is in prefill,
    and the forward's rows (for a verifying sequence, its last token and each draft one row: engine/
    speculative.py), with each row's cached length and block table."""

    new_tokens: list[list[int]]
    in_prefill: list[bool]
    rows: list[list[int]]
    cached: list[int]
    tables: list[list[int]]
    drafts: list[list[int]] | None = None  # each sequence's drafts ([] for none), None without speculation
    row_counts: list[int] | None = None  # rows of each sequence in the forward
    reread: int = 0  # context tokens the draft rows read again (the step's bytes)

    @property
    def verifying(self) -> bool:
        return bool(self.drafts) and any(self.drafts)


class StepRunner:
    """The eager runner: each op called from Python on torch's threads; every other runner is one.

    `layers(batch, kv, all_positions, chained)` is the model's layer loop; `threads` the context a
    decode step runs in (the extension's StepThreads, or TorchThreads without it), which counts each
    step by the threads it ran on."""

    name = "eager"
    pool = False  # whether a decode step's parallel work runs on the extension's thread pool

    def __init__(self, model, layers, threads, requested: str, why: str, decode_kind: str, ext=None):
        self.model = model
        self.layers = layers
        self.threads = threads
        self.requested = requested
        self.why = why
        self.chains = False
        self._decode_kind = decode_kind
        # decode steps by how their layers ran, batch by batch (a dict the model's evidence shares)
        self.decode_steps: dict[str, int] = {}
        self._ext = ext  # the extension whose streamed-dot counters the evidence reads, if any
        self._streams_start = dict(ext.simd_stats()) if ext is not None and hasattr(ext, "simd_stats") else None

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, kv, all_positions: bool = False) -> torch.Tensor:
        """Logits of each sequence's last new token, [B, vocab] float32 (every new token with all_positions)."""
        if batch.max_q != 1:  # prefill and mixed steps keep torch's threads
            return self.layers(batch, kv, all_positions, False)
        with self.threads:
            return self.decode(batch, kv, all_positions)

    def decode(self, batch: ForwardBatch, kv, all_positions: bool) -> torch.Tensor:
        self._count(self._decode_kind)
        return self.layers(batch, kv, all_positions, False)

    def _count(self, kind: str) -> None:
        self.decode_steps[kind] = self.decode_steps.get(kind, 0) + 1

    def evidence(self) -> dict:
        return {"requested": self.requested, "path": self.name, "why": self.why, "chains": self.chains,
                "step_pool": self.pool, "decode_threads": dict(self.threads.seen()),
                "decode_steps": dict(self.decode_steps), "streamed_dots": self.streamed_dots()}

    def activation_errors(self) -> list[str]:
        return []

    def streamed_dots(self) -> dict | None:
        """Which kernel the extension's streamed dot products and tiles of 4+ tokens ran in this process
        (avx512 or avx2, kernels/csrc/cpu_common.h) and the weight rows each streamed (1-3 tokens) or
        tiled (4+) since this runner was made, as the extension counted them, and the run length its
        streamed items aim at now (0: fixed row counts); None without the extension."""
        if self._streams_start is None:
            return None
        now = dict(self._ext.simd_stats())
        counted = [k for k in now if k.endswith("_rows")]
        run_bytes = {"stream_run_bytes": self._ext.stream_run_bytes()} if hasattr(self._ext, "stream_run_bytes") else {}
        return {"kernel": now["streams"], **{k: now[k] - self._streams_start[k] for k in counted}, **run_bytes}


class ChainedRunner(StepRunner):
    """A decode step of at most STEP_OP_MAX_ROWS rows: its attention sub-layers and routers one native
    call each (`chains`; without them the same ops one by one), on the step's thread pool. More rows
    run the ops one by one, counted as OVER_ROWS."""

    name = "chained"
    pool = True

    def __init__(self, model, layers, threads, requested: str, why: str, chains: bool, ext=None):
        super().__init__(model, layers, threads, requested, why, LAYER_BY_LAYER, ext)
        self.chains = chains

    def decode(self, batch: ForwardBatch, kv, all_positions: bool) -> torch.Tensor:
        fits = batch.batch_size <= STEP_OP_MAX_ROWS
        self._count(LAYER_BY_LAYER if fits else OVER_ROWS)
        return self.layers(batch, kv, all_positions, self.chains and fits)


class NativeRunner(ChainedRunner):
    """A decode step of at most STEP_OP_MAX_ROWS rows in one native call: `native` (the extension's
    DecodeLayers over the model's weights and the resident experts) from the token ids to the logits,
    or to the final norm's output where the LM head runs after it. The MoE block is told afterwards
    what its layers chose (MoeBlock.ran_natively). More rows run the chained ops, counted as OVER_ROWS."""

    name = "native"

    def __init__(self, model, layers, threads, requested: str, why: str, native, moe_block, head_inside: bool,
                 ext=None):
        super().__init__(model, layers, threads, requested, why, True, ext)
        self.native = native
        self.moe_block = moe_block
        self.head_inside = head_inside
        self.rope = model.rope
        self.attention_calls = model.attention_backends  # the model's evidence of decode attention calls

    def decode(self, batch: ForwardBatch, kv, all_positions: bool) -> torch.Tensor:
        if batch.batch_size > STEP_OP_MAX_ROWS:
            self._count(OVER_ROWS)
            return self.layers(batch, kv, all_positions, False)
        rope = self.rope
        if batch.max_position >= rope.cos.shape[0]:
            rope.ensure(batch.max_position)
        x, topk_ids, distinct = self.native.run(batch.input_ids, rope.cos, rope.sin, batch.positions,
                                                batch.slot_mapping, batch.context_blocks, batch.context_lens,
                                                kv.block_size, kv.k, kv.v)
        self.moe_block.ran_natively(topk_ids, distinct)
        calls = self.attention_calls
        calls["cpp-block"] = calls.get("cpp-block", 0) + len(topk_ids)
        self._count(NATIVE)
        if self.head_inside:  # every sequence's one new token: x is the logits already
            return x
        model = self.model
        if model.keep_hidden:
            model.last_hidden = x
        return model.logits(x)

    def activation_errors(self) -> list[str]:
        ran = self.decode_steps
        if ran and not ran.get(NATIVE):
            return [f"decode path native: no decode step ran in one native call ({ran})"]
        return []


class TorchThreads:
    """StepThreads without the extension: no pool to hand threads to; steps counted by torch's threads."""

    def __init__(self):
        self._seen: dict[str, int] = {}

    def __enter__(self):
        key = f"pool=0 torch={torch.get_num_threads()}"
        self._seen[key] = self._seen.get(key, 0) + 1
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def seen(self) -> dict[str, int]:
        return dict(self._seen)
