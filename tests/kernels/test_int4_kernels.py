"""The C++ int4 kernels (kernels/csrc/int4_cpu.h): the dense and fused MoE kernels on Q4_0 rows give the
float32 kernels' results on the dequantized weights bit for bit, and agree with the torch reference
to float32 rounding, at odd shapes (1-3 tokens streamed, 4+ tiled, rows left over, pool slots); the
engine streams int4 on every decode path with its evidence; AVX-512 against AVX2 where the CPU has it."""

import os
import subprocess
import sys

import pytest
import torch

from moebench.engine.quantize import pack_int4_rows
from moebench.kernels.cpu_moe import load_extension, weight_formats
from moebench.kernels.reference import dequantize_int4_rows, moe_reference, rows_linear_reference

ext = load_extension()
needs_int4 = pytest.mark.skipif(ext is None or torch.uint8 not in weight_formats("dense"),
                                reason="the C++ extension did not build")


def _matrix(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3


def _bound(x, w):
    """A float32 rounding bound for x @ dequantized(w).T summed in any order."""
    return 1e-5 * x.shape[1] ** 0.5 * (x.abs() @ dequantize_int4_rows(w).abs().T) + 1e-6


@needs_int4
def test_the_table_names_int4():
    f = weight_formats("dense")[torch.uint8]
    assert f["dtype"] == "int4" and (f["block_values"], f["block_bytes"]) == (32, 18)
    assert torch.uint8 in weight_formats("experts") and torch.uint8 not in weight_formats("lm_head")


@needs_int4
@pytest.mark.parametrize("rows,cols,tokens", [(1, 32, 1), (7, 96, 2), (33, 160, 3), (64, 64, 4), (130, 96, 5),
                                             (257, 224, 16), (300, 1024, 17), (13, 32, 32)])
def test_dense_kernel_is_the_float_kernel_on_the_dequantized_rows(rows, cols, tokens):
    w = pack_int4_rows(_matrix(rows, cols, seed=rows + cols))
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    bias = torch.randn(rows)
    got = ext.dense_linear(x, w, bias)
    assert torch.equal(got, ext.dense_linear(x, dequantize_int4_rows(w), bias))
    want = rows_linear_reference(x, w) + bias
    assert ((got - want).abs() <= _bound(x, w) + 1e-5 * bias.abs()).all(), (got - want).abs().max()


@needs_int4
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 4), (5, 2), (16, 2), (40, 3)])
def test_fused_moe_kernel_is_the_float_kernel_on_the_dequantized_experts(tokens, top_k):
    E, H, I = 7, 96, 160
    w13, w2 = pack_int4_rows(_matrix(E, 2 * I, H, seed=2)), pack_int4_rows(_matrix(E, H, I, seed=3))
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    got = ext.fused_moe(x, weights, ids, w13, w2)
    assert torch.equal(got, ext.fused_moe(x, weights, ids, dequantize_int4_rows(w13), dequantize_int4_rows(w2)))
    want = moe_reference(x, weights, ids, w13, w2)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max()), (got - want).abs().max()
    # a pool's slots (a view of a larger buffer), as an expert store hands them in
    pool13, pool2 = torch.cat([w13, w13]), torch.cat([w2, w2])
    assert torch.equal(ext.fused_moe(x, weights, ids + E, pool13, pool2), got)
    # every token on the same two experts: the tiles of 4+ tokens per expert
    shared = torch.tensor([[1, 4]]).expand(tokens, 2).contiguous()
    tw = weights[:, :2].contiguous()
    assert torch.equal(ext.fused_moe(x, tw, shared, w13, w2),
                       ext.fused_moe(x, tw, shared, dequantize_int4_rows(w13), dequantize_int4_rows(w2)))


@needs_int4
def test_the_kernels_count_int4_bytes_and_refuse_partial_blocks():
    w = pack_int4_rows(_matrix(64, 96, seed=4))
    before = ext.weight_stats()["dense"].get("int4", {"calls": 0, "bytes": 0})
    ext.dense_linear(torch.randn(2, 96), w)
    after = ext.weight_stats()["dense"]["int4"]
    assert after["calls"] - before["calls"] == 1 and after["bytes"] - before["bytes"] == 64 * 54
    with pytest.raises(RuntimeError):
        ext.dense_linear(torch.randn(2, 80), w[:, :45])  # 80 values are not whole blocks


# ------------------------------------------------------------------ the engine, every decode path


@needs_int4
def test_engine_streams_int4_on_every_decode_path_and_says_so(tmp_path):
    from test_int4_weights import _generate, _tiny

    _, ckpt = _tiny(tmp_path)
    outputs = {}
    for kernel, path in (("naive", "eager"), ("fused", "chained"), ("fused", "native")):
        result = _generate(ckpt, kernel=kernel, decode_path=path, weights="int4")
        assert not result.activation_errors, result.activation_errors
        ev = result.evidence["weights"]
        assert ev["precision"] == "int4" and ev["held"] == {"dense": "int4", "experts": "int4"}
        assert ev["kernel"]["dense"]["int4"]["bytes"] > 0
        if kernel == "fused":
            assert set(ev["kernel"]["experts"]) == {"int4"}
        outputs[(kernel, path)] = [c.output_ids for c in result.completions]
    assert outputs[("fused", "chained")] == outputs[("fused", "native")] == outputs[("naive", "eager")]


# ------------------------------------------------------------------ AVX-512 against AVX2

COMPUTE = r"""
import os, sys, torch
from moebench.engine.overrides import Overrides, apply_process_overrides
from moebench.engine.quantize import pack_int4_rows
from moebench.kernels.cpu_moe import load_extension
apply_process_overrides(Overrides.from_environment(os.environ))
ext = load_extension()
g = torch.Generator().manual_seed(0)
out = {}
for k in (1024, 96):
    for m in (64, 13):
        w = pack_int4_rows(torch.randn(m, k, generator=g))
        for n in (1, 2, 3, 4, 7, 16):
            out[f"dense {k} {m} {n}"] = ext.dense_linear(torch.randn(n, k, generator=g), w, None)
E, H, I = 8, 256, 96
w13, w2 = pack_int4_rows(torch.randn(E, 2 * I, H, generator=g)), pack_int4_rows(torch.randn(E, H, I, generator=g))
for n in (1, 2, 3, 5, 16):
    x = torch.randn(n, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n)])
    out[f"moe {n}"] = ext.fused_moe(x, torch.rand(n, 2, generator=g), ids, w13, w2)
torch.save({"out": out, "simd": dict(ext.simd_stats())}, sys.argv[1])
"""


@needs_int4
@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(), reason="this CPU has no AVX-512")
def test_int4_avx512_twins_give_the_avx2_results_bit_for_bit(tmp_path):
    runs = {}
    for flag in ("1", "0"):
        path = tmp_path / f"avx512-{flag}.pt"
        subprocess.run([sys.executable, "-c", COMPUTE, str(path)], check=True,
                       env={**os.environ, "MOEBENCH_AVX512": flag})
        runs[flag] = torch.load(path)
    assert runs["1"]["simd"]["avx512_rows"] > 0 and runs["0"]["simd"]["avx512_rows"] == 0
    for key, value in runs["0"]["out"].items():
        assert torch.equal(runs["1"]["out"][key], value), key
