"""The decode-time dot products' AVX-512 kernel (kernels/csrc/cpu_common.h: dot_streams_avx512) gives
the AVX2 kernel's results bit for bit: the dense projections, the LM head (float32, bfloat16, int8
and fp8 rows with their scales), int8 rows that carry their scale, and the fused MoE op, at 1-3
tokens (the streamed rows) and at 4-23 (the tiles: with AVX-512 a dense tile takes up to 6 tokens a
pass in its 32 registers, with AVX2 up to 3, and an expert's 8 rows x 3 tokens one pass instead of
two; experts that every token routes to take that path for sure), on odd widths (every tail path). Each kernel runs in
its own process (the choice is made once per process; MOEBENCH_AVX512=0 keeps AVX2), which also
reports the rows it streamed and tiled with each kernel (simd_stats, the activation evidence)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moebench.kernels.cpu_moe import load_extension

COMPUTE = r"""
import os, sys, torch
from moebench.engine.overrides import Overrides, apply_process_overrides
from moebench.engine.quantize import pack_int8_rows, quantize_lm_head
from moebench.kernels.cpu_moe import load_extension
apply_process_overrides(Overrides.from_environment(os.environ))  # this script's entry: MOEBENCH_AVX512
ext = load_extension()
g = torch.Generator().manual_seed(0)
out = {}
for k in (1024, 200, 77):
    for m in (64, 13):
        w = torch.randn(m, k, generator=g)
        for n in (1, 2, 3, 4, 5, 7, 13, 16, 23):
            x = torch.randn(n, k, generator=g)
            out[f"f32 {k} {m} {n}"] = ext.dense_linear(x, w, None)
            out[f"bf16 {k} {m} {n}"] = ext.dense_linear(x, w.bfloat16(), None)
            if k % 4 == 0:
                out[f"int8 rows {k} {m} {n}"] = ext.dense_linear(x, pack_int8_rows(w), None)
            for dtype in ("int8", "fp8"):
                q, scale = quantize_lm_head(w, dtype)
                out[f"head {dtype} {k} {m} {n}"] = ext.lm_head_linear(x, q, scale)
E, H, I = 8, 256, 96
w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 16, torch.randn(E, H, I, generator=g) / 16
for n in (1, 2, 3, 5, 7, 16):
    x = torch.randn(n, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n)])
    tw = torch.rand(n, 2, generator=g)
    out[f"moe f32 {n}"] = ext.fused_moe(x, tw, ids, w13, w2)
    out[f"moe bf16 {n}"] = ext.fused_moe(x, tw, ids, w13.bfloat16(), w2.bfloat16())
    shared = torch.randperm(E, generator=g)[:2].expand(n, 2).contiguous()  # every token: the same 2 experts
    out[f"moe shared f32 {n}"] = ext.fused_moe(x, tw, shared, w13, w2)
    out[f"moe shared bf16 {n}"] = ext.fused_moe(x, tw, shared, w13.bfloat16(), w2.bfloat16())
torch.save({"out": out, "simd": dict(ext.simd_stats())}, sys.argv[1])
"""


def _cpu_has_avx512() -> bool:
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl"))


def _run(tmp_path, avx512: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MOEBENCH_AVX512"}
    if avx512 is not None:
        env["MOEBENCH_AVX512"] = avx512
    path = tmp_path / f"out-{avx512}.pt"
    subprocess.run([sys.executable, "-c", COMPUTE, str(path)], env=env, check=True, timeout=600)
    return torch.load(path)


@pytest.mark.skipif(load_extension() is None, reason="the C++ extension did not build here")
def test_the_avx512_streams_give_the_avx2_results_bit_for_bit(tmp_path):
    avx2 = _run(tmp_path, "0")
    default = _run(tmp_path, None)
    assert avx2["simd"]["streams"] == "avx2" and avx2["simd"]["avx512_rows"] == 0 and avx2["simd"]["avx2_rows"] > 0
    assert avx2["simd"]["avx512_tiled_rows"] == 0 and avx2["simd"]["avx2_tiled_rows"] > 0
    if not _cpu_has_avx512():
        assert default["simd"]["streams"] == "avx2"
        pytest.skip("this CPU has no AVX-512: only the AVX2 kernel ran")
    assert default["simd"]["streams"] == "avx512" and default["simd"]["avx512_rows"] > 0
    assert default["simd"]["avx2_rows"] == 0
    assert default["simd"]["avx512_tiled_rows"] > 0 and default["simd"]["avx2_tiled_rows"] == 0
    assert avx2["out"].keys() == default["out"].keys()
    differ = [k for k, v in avx2["out"].items() if not torch.equal(v, default["out"][k])]
    assert differ == []
