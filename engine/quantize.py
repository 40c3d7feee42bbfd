"""Weight-only round-to-nearest quantization: the negative control (the routed experts), the LM head's
precision (--lm-head) and the other streamed weights' precision (--weights int8, int4).

The negative control is deliberately approximate (symmetric per-group RTN, dequantized back to the
compute dtype), so answers DO change; a run that includes it proves the accuracy check can detect a
change.
"""

from __future__ import annotations

import copy

import torch

from moebench.engine.config import WEIGHT_PRECISIONS  # f32: the checkpoint's own precision
from moebench.errors import MoebenchError
from moebench.kernels.reference import INT4_GROUP, PACKED_EXTRA, stored_columns  # the packed rows' layouts

SCHEMES = {"int4": 4, "int3": 3, "int2": 2}


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Quantize-dequantize along the last (input) dimension in groups of `group_size`."""
    *lead, k = w.shape
    if k % group_size:
        group_size = k
    groups = w.float().reshape(*lead, k // group_size, group_size)
    qmax = 2 ** (bits - 1) - 1
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
    q = torch.clamp(torch.round(groups / scale), -qmax - 1, qmax)
    return (q * scale).reshape(w.shape).to(w.dtype)


def quantize_experts(ckpt, scheme: str, group_size: int = 32):
    """A copy of `ckpt` sharing every tensor except the routed experts, which are RTN-quantized."""
    if scheme not in SCHEMES:
        raise MoebenchError(f"unknown expert quantization '{scheme}' (choose from: {', '.join(SCHEMES)})")
    bits = SCHEMES[scheme]
    out = copy.copy(ckpt)
    out.layers = []
    # Experts left in the files (load_checkpoint(load_experts=False), the disk tier) are read for the
    # copy; the copy's experts exist only in memory, so it has no file sources a disk tier could read.
    on_disk = {}
    if ckpt.expert_sources and any(layer.w13 is None and layer.router is not None for layer in ckpt.layers):
        from moebench.engine.store.expert_store import read_all_experts
        from moebench.engine.store.tiers import expert_file_dtype

        on_disk = read_all_experts(ckpt, expert_file_dtype(ckpt))
    out.expert_sources = {}
    for i, layer in enumerate(ckpt.layers):
        q = copy.copy(layer)
        w13, w2 = on_disk.get(i, (layer.w13, layer.w2))
        if w13 is not None:
            q.w13 = quantize_rtn(w13, bits, group_size)
            q.w2 = quantize_rtn(w2, bits, group_size)
        out.layers.append(q)
    out.quantized = scheme
    return out


# ---- the LM head's precision (--lm-head): an approximate optimization users make ----------------
#
# Weight-only: the head's rows are stored in a lower precision and the kernel widens them in
# registers, accumulating in float32 (kernels/cpu_dense.lm_head). int8 and fp8 keep one float32
# scale per output row (per vocabulary entry): a row's largest magnitude maps to the format's
# largest value. Routers and every other weight stay as loaded.

LM_HEAD_DTYPES = ("f32", "bf16", "int8", "fp8")
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # e4m3fn's largest finite value


def quantize_lm_head(w: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weights, row scale or None) for an LM head of `dtype`: f32 is `w` itself; bf16 rounds to
    nearest; int8 rounds w / scale to nearest in [-127, 127]; fp8 casts w / scale to e4m3fn
    (round to nearest even). w * 1 ~ weights[r] * scale[r] for every row r."""
    if dtype not in LM_HEAD_DTYPES:
        raise MoebenchError(f"unknown LM head precision '{dtype}' (choose from: {', '.join(LM_HEAD_DTYPES)})")
    if dtype == "f32":
        return w, None
    wf = w.float()
    if dtype == "bf16":
        return wf.to(torch.bfloat16), None
    if dtype == "int8":
        return int8_rows(wf)
    scale = _row_scale(wf, FP8_E4M3_MAX)
    q = torch.clamp(wf / scale[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def _row_scale(wf: torch.Tensor, top: float) -> torch.Tensor:
    """Each row's (last dimension's) largest magnitude over `top`; an all-zero row gets 1 (its values
    are 0 in any format)."""
    amax = wf.abs().amax(dim=-1)
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale float32) with one scale per row of the last dimension (any leading dims):
    scale = the row's max |w| / 127, q = round(w / scale) in [-127, 127], so w ~ q * scale."""
    wf = w.float()
    scale = _row_scale(wf, INT8_MAX)
    q = torch.clamp(torch.round(wf / scale[..., None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.contiguous()


def lm_head_for(ckpt, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The checkpoint's LM head in `dtype` (quantize_lm_head), made once per checkpoint and dtype and
    placed in huge pages like the head it copies (a decode step streams it whole)."""
    if dtype == "f32":
        return ckpt.lm_head, None
    made = ckpt.__dict__.setdefault("_lm_head_variants", {})
    if dtype not in made:
        from moebench.engine.memory import to_huge_pages

        q, scale = quantize_lm_head(ckpt.lm_head, dtype)
        made[dtype] = (to_huge_pages(q.contiguous()) if q.device.type == "cpu" else q.contiguous(), scale)
    return made[dtype]


def lm_head_bytes(vocab: int, hidden: int, dtype: str, full_element_size: int) -> int:
    """Bytes one pass over an LM head of `dtype` reads: its weights (f32: the runtime's own element
    size) and, for int8 and fp8, a float32 scale per row."""
    per_value = {"f32": full_element_size, "bf16": 2, "int8": 1, "fp8": 1}[dtype]
    return vocab * hidden * per_value + (4 * vocab if dtype in ("int8", "fp8") else 0)


# ---- the weights' precision (--weights): 8-bit weights a decode step streams ----------------------
#
# Weight-only, per output channel: every matrix a decode step streams, except the routers, the
# embeddings and the LM head (--lm-head), is held as int8 with one float32 scale per output row
# (int8_rows, as the int8 LM head), and the kernels widen the bytes in registers and accumulate in
# float32 (docs/int8.md). The scale lives in the row itself (pack_int8_rows): an expert store moves
# an expert's scales with its rows, and every op that took a float matrix takes the packed one.


def pack_int8_rows(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] -> int8 [..., K + 8]: each row's int8 values (int8_rows), then its float32 scale's 4
    bytes, then 4 zero bytes (kernels/csrc/cpu_common.h reads this layout; K a multiple of 4 keeps
    the scales aligned)."""
    *lead, k = w.shape
    if k % 4:
        raise MoebenchError(f"--weights int8: rows of {k} values (the kernels need a multiple of 4)")
    q, scale = int8_rows(w)
    out = torch.zeros(*lead, k + PACKED_EXTRA, dtype=torch.int8, device=w.device)
    out[..., :k] = q
    out[..., k:k + 4] = scale.unsqueeze(-1).view(torch.int8)
    return out


def packed_columns(w: torch.Tensor) -> int:
    """The input width K of a matrix: its last dimension, less 8 for packed int8 rows; for int4 rows
    (uint8), 32 values per 18-byte block."""
    return stored_columns(w.shape[-1], w.dtype)


# ---- 4-bit weights (--weights int4, docs/int4.md) -------------------------------------------------
#
# Groups of 32 along the input dimension in llama.cpp's Q4_0 layout and with its quantizer's rule, so
# that the runtime's bytes are the GGUF's (`export gguf --dtype q4_0`) and a Q4_0 file llama.cpp made
# from the same float weights holds the same values: per block, d = the value of largest magnitude
# (its sign kept) / -8, q = trunc(w / d + 8.5) clipped to [0, 15] (w / d computed as w * (1 / d), in
# float32, as gguf's quantizer does), d stored as float16; the value is (q - 8) * d.


def pack_int4_rows(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] -> uint8 [..., K / 32 * 18]: Q4_0 blocks (kernels/reference.py: unpack_int4_rows reads
    them). K must be a multiple of 32."""
    *lead, k = w.shape
    if k % INT4_GROUP:
        raise MoebenchError(f"--weights int4: rows of {k} values (groups of {INT4_GROUP}: a multiple of {INT4_GROUP})")
    blocks = w.float().reshape(*lead, k // INT4_GROUP, INT4_GROUP)
    signed_max = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # the first of equal magnitudes
    d = signed_max / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.clamp(torch.trunc(blocks * inverse + 8.5), 0, 15).to(torch.uint8)
    half = INT4_GROUP // 2
    nibbles = q[..., :half] | (q[..., half:] << 4)
    scale = d.to(torch.float16).view(torch.uint8)  # [..., blocks, 2]: little-endian, as GGUF stores it
    return torch.cat([scale, nibbles], dim=-1).reshape(*lead, -1).contiguous()


# the per-layer matrices a decode step streams that --weights int8 quantizes (routers stay float32:
# they decide which experts run, and are 2% of a step's bytes at the benchmark shape, docs/int8.md)
_LAYER_MATRICES = ("qkv_proj", "o_proj", "w13", "w2", "dense_w13", "dense_w2", "shared_w13", "shared_w2")


def weights_in(ckpt, precision: str):
    """The checkpoint with its weights in `precision`: f32 is `ckpt` itself; int8 or int4 a copy (made
    once per checkpoint) sharing every tensor except the matrices of _LAYER_MATRICES, which are packed
    int8 rows (pack_int8_rows) or int4 rows (pack_int4_rows). Its `weights` attribute names the
    precision."""
    if precision not in WEIGHT_PRECISIONS:
        raise MoebenchError(f"unknown weight precision '{precision}' (choose from: {', '.join(WEIGHT_PRECISIONS)})")
    if precision == "f32":
        return ckpt
    made = ckpt.__dict__.setdefault("_weight_variants", {})
    if precision in made:
        return made[precision]
    from moebench.engine.memory import to_huge_pages

    out = copy.copy(ckpt)
    out.__dict__.pop("_weight_variants", None)
    on_disk = {}
    if ckpt.expert_sources and any(layer.w13 is None and layer.router is not None for layer in ckpt.layers):
        from moebench.engine.store.expert_store import read_all_experts
        from moebench.engine.store.tiers import expert_file_dtype

        on_disk = read_all_experts(ckpt, expert_file_dtype(ckpt))
    out.expert_sources = {}  # the quantized experts exist only in memory: no file a disk tier could read
    out.layers = []
    for i, layer in enumerate(ckpt.layers):
        q = copy.copy(layer)
        if i in on_disk:
            q.w13, q.w2 = on_disk[i]
        for name in _LAYER_MATRICES:
            w = getattr(q, name, None)
            if isinstance(w, torch.Tensor) and w.is_floating_point():
                packed = pack_int4_rows(w) if precision == "int4" else pack_int8_rows(w)
                setattr(q, name, to_huge_pages(packed) if packed.device.type == "cpu" else packed)
        out.layers.append(q)
    out.weights = precision
    made[precision] = out
    return out
