"""Weight-only round-to-nearest quantization of the routed experts: the negative control.

It is deliberately approximate (symmetric per-group RTN, dequantized back to the compute dtype),
so answers DO change; a run that includes it proves the accuracy check can detect a change.
"""

from __future__ import annotations

import copy

import torch

from moebench.errors import MoebenchError

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
        from moebench.engine.expert_store import read_all_experts
        from moebench.engine.offload import expert_file_dtype

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
