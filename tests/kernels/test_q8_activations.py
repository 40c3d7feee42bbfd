"""int4 weights and row-scaled int8 weights with q8 activations (the activations override,
kernels/csrc/q8_cpu.h, docs/int4.md): an approximation, off by default. The dense kernel and the int8 LM
head equal their reference (kernels/reference.py: q8_linear_reference) bit for bit at odd shapes, 1-3
tokens streamed and more in groups of 3, rows left over; the fused MoE kernel agrees with
moe_q8_reference to the bound its SiLU allows; the quantizer is ggml's rule; the switch is off unless
set, counted where it ran, refused where it cannot run."""

import warnings

import pytest
import torch

from moebench.engine.overrides import Overrides, apply_process_overrides
from moebench.engine.quantize import pack_int4_rows, pack_int8_rows, quantize_lm_head
from moebench.errors import MoebenchError
from moebench.kernels.cpu_moe import load_extension, weight_formats
from moebench.kernels.reference import (dequantize_int4_rows, moe_q8_reference, moe_reference, q8_linear_reference,
                                        quantize_q8_rows, rows_linear_reference, unpack_int8_rows)

ext = load_extension()
needs_q8 = pytest.mark.skipif(ext is None or not hasattr(ext, "set_activations"),
                              reason="the C++ extension did not build")


def _matrix(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3


PACK = {"int4": pack_int4_rows, "int8": pack_int8_rows}


def _dequantized(w):
    if w.dtype == torch.uint8:
        return dequantize_int4_rows(w)
    values, scale = unpack_int8_rows(w)
    return values.float() * scale[..., None]


@pytest.fixture
def q8():
    ext.set_activations("q8")
    try:
        yield
    finally:
        ext.set_activations("f32")


def test_the_quantizer_is_ggmls_rule():
    x = torch.tensor([[0.0] * 32, [1.0] + [0.0] * 31, [-2.0, 1.0, 0.5] + [0.0] * 29]).float()
    q, d = quantize_q8_rows(x)
    assert q.dtype == torch.int8 and d.shape == (3, 1)
    assert (q[0] == 0).all() and d[0, 0] == 0  # an all-zero block: no division by zero
    assert q[1, 0] == 127 and d[1, 0] == torch.tensor(1.0) / 127
    assert q[2, 0] == -127 and q[2, 1] == 64 and q[2, 2] == 32  # 63.5 and 31.75: half to even, then nearest
    x = torch.randn(5, 96) * 4
    q, d = quantize_q8_rows(x)
    back = (q.float().reshape(5, 3, 32) * d[..., None]).reshape(5, 96)
    assert ((back - x).abs() <= d.repeat_interleave(32, dim=1) / 2 * (1 + 1e-5)).all()


@needs_q8
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("rows,cols,tokens", [(1, 32, 1), (7, 96, 2), (33, 160, 3), (64, 64, 4), (130, 96, 5),
                                             (257, 224, 16), (300, 1024, 17), (13, 32, 32), (5, 2048, 1)])
def test_dense_kernel_is_its_reference_bit_for_bit(q8, weights, rows, cols, tokens):
    w = PACK[weights](_matrix(rows, cols, seed=rows + cols))
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)) * 2
    x[0, :32] = 0  # an all-zero block
    bias = torch.randn(rows)
    before = ext.simd_stats()
    got = ext.dense_linear(x, w, bias)
    after = ext.simd_stats()
    assert torch.equal(got, q8_linear_reference(x, w, bias))
    assert after["q8_weight_rows"] - before["q8_weight_rows"] == rows
    assert after["q8_activation_rows"] - before["q8_activation_rows"] == tokens
    # the approximation: close to the weight-only product, not equal to it
    exact = rows_linear_reference(x, w) + bias
    scale = x.abs().amax() / 127 * _dequantized(w).abs().sum(dim=1)
    assert ((got - exact).abs() <= scale[None, :]).all()


@needs_q8
@pytest.mark.parametrize("rows,cols,tokens", [(9, 64, 1), (100, 96, 3), (515, 1024, 2), (31, 160, 16)])
def test_int8_lm_head_with_q8_activations_is_its_reference_bit_for_bit(q8, rows, cols, tokens):
    weight, scale = quantize_lm_head(_matrix(rows, cols, seed=rows), "int8")
    weight[0, :32] = -128  # the one value quantize_lm_head never writes: |w| = 128 still fits maddubs' pairs
    weight[-1, 32:64] = 127
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(cols)) * 3
    x[-1, 32:64] = -x[-1, 32:64].abs()  # a block whose products are all at their largest size
    before = ext.simd_stats()
    got = ext.lm_head_linear(x, weight, scale)
    after = ext.simd_stats()
    assert torch.equal(got, q8_linear_reference(x, weight, scale=scale))
    assert after["q8_weight_rows"] - before["q8_weight_rows"] == rows


@needs_q8
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 4), (5, 2), (16, 2), (40, 3)])
def test_fused_moe_kernel_agrees_with_its_reference(q8, weights, tokens, top_k):
    E, H, I = 7, 96, 160
    w13, w2 = PACK[weights](_matrix(E, 2 * I, H, seed=2)), PACK[weights](_matrix(E, H, I, seed=3))
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    before = ext.simd_stats()
    got = ext.fused_moe(x, weights, ids, w13, w2)
    after = ext.simd_stats()
    assert after["q8_activation_rows"] - before["q8_activation_rows"] == tokens + tokens * top_k
    assert after["q8_weight_rows"] > before["q8_weight_rows"]
    want = moe_q8_reference(x, weights, ids, w13, w2)
    # Equal but where SiLU differs: the kernel's is g / (1 + expf(-g)) in C, the reference's torch's exp,
    # which may differ in the last bit on some CPUs; quantizing h can turn that into one step of one value
    # of h. On this machine (AVX2, torch 2.13) every output was equal.
    assert (got == want).float().mean() >= 0.99
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    # the approximation against the weight-only kernel
    with warnings.catch_warnings():  # the weight-only reference: it says that q8 does not apply in it
        warnings.simplefilter("ignore", RuntimeWarning)
        exact = moe_reference(x, weights, ids, w13, w2)
    assert torch.allclose(got, exact, rtol=0.1, atol=0.05 * exact.abs().max())
    # a pool's slots (a view of a larger buffer), as an expert store hands them in
    pool13, pool2 = torch.cat([w13, w13]), torch.cat([w2, w2])
    assert torch.equal(ext.fused_moe(x, weights, ids + E, pool13, pool2), got)


@needs_q8
def test_off_unless_asked_for_and_only_for_int4_and_int8():
    assert ext.activations() == "f32"
    w = pack_int4_rows(_matrix(64, 96, seed=4))
    x = torch.randn(2, 96)
    before = ext.simd_stats()["q8_weight_rows"]
    assert torch.equal(ext.dense_linear(x, w), ext.dense_linear(x, dequantize_int4_rows(w)))
    assert ext.simd_stats()["q8_weight_rows"] == before
    ext.set_activations("q8")
    try:
        wf = dequantize_int4_rows(w)  # float weights: no q8 kernel, the float one (and nothing counted)
        ext.dense_linear(x, wf)
        assert ext.simd_stats()["q8_weight_rows"] == before
        assert ext.simd_stats()["activations"] == "q8"
    finally:
        ext.set_activations("f32")
    with pytest.raises(RuntimeError):
        ext.set_activations("q4")


@needs_q8
def test_the_override_reaches_the_kernel_and_is_refused_where_none_runs():
    assert Overrides.from_environment({"MOEBENCH_ACTIVATIONS": "q8"}).activations == "q8"
    assert Overrides().changed() == {} and Overrides(activations="q8").changed() == {"activations": "q8"}
    with pytest.raises(MoebenchError):
        Overrides.from_environment({"MOEBENCH_ACTIVATIONS": "int8"})
    try:
        apply_process_overrides(Overrides(activations="q8"))
        assert ext.activations() == "q8"
        apply_process_overrides(Overrides())  # a later engine of the process does not inherit it
        assert ext.activations() == "f32"
    finally:
        ext.set_activations("f32")
    with pytest.raises(MoebenchError, match="MOEBENCH_ACTIVATIONS=q8"):
        apply_process_overrides(Overrides(activations="q8"), extension=False)
    with pytest.warns(RuntimeWarning, match="FALLBACK"):
        apply_process_overrides(Overrides(activations="q8", allow_fallback=True), extension=False)


@needs_q8
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_engine_runs_q8_on_every_decode_path_and_counts_it(tmp_path, weights):
    from test_int4_weights import _generate, _tiny  # beside this file

    from moebench.measuring.bench_engine_q8 import find as _find

    _, ckpt = _tiny(tmp_path)
    outputs = {}
    try:
        for kernel, path in (("fused", "chained"), ("fused", "native")):
            result = _generate(ckpt, kernel=kernel, decode_path=path, weights=weights,
                               overrides=Overrides(activations="q8"))
            assert not result.activation_errors, result.activation_errors
            dots = _find(result.evidence, "streamed_dots")
            assert dots["q8_weight_rows"] > 0 and dots["q8_activation_rows"] > 0, dots
            outputs[path] = [c.output_ids for c in result.completions]
        assert outputs["chained"] == outputs["native"]
        plain = _generate(ckpt, kernel="fused", decode_path="native", weights=weights)
        assert _find(plain.evidence, "streamed_dots")["q8_weight_rows"] == 0  # off unless asked for
    finally:
        ext.set_activations("f32")


@needs_q8
def test_q8_asked_for_where_no_kernel_quantizes_fails_the_activation_check(tmp_path):
    from test_int4_weights import _generate, _tiny  # beside this file

    _, ckpt = _tiny(tmp_path)
    try:  # int4 experts on the naive kernel (torch, float32 activations) and dense projections that
        # stay in torch: int4 rows streamed and no activation row quantized, so the switch did nothing
        result = _generate(ckpt, kernel="naive", decode_path="eager", weights="int4",
                           overrides=Overrides(activations="q8", dense="torch", allow_fallback=True))
        assert any("activations q8: no activation row was quantized" in e for e in result.activation_errors), \
            result.activation_errors
        # float32 weights: nothing for q8 to meet in this config (an ablation's baseline), so nothing to fail
        float_config = _generate(ckpt, kernel="fused", decode_path="chained", overrides=Overrides(activations="q8"))
        assert not float_config.activation_errors
    finally:
        ext.set_activations("f32")


def test_a_run_whose_configs_stream_no_int_rows_is_refused_q8():
    from moebench.engine import RuntimeConfig
    from moebench.engine.weight_evidence import activations_refusal

    floats, int4, head = RuntimeConfig(), RuntimeConfig(weights="int4"), RuntimeConfig(lm_head="int8")
    assert "MOEBENCH_ACTIVATIONS=q8: no config of this run streams int4 or int8 rows" in \
        activations_refusal("q8", [floats, floats])
    assert activations_refusal("q8", [floats, int4]) is None and activations_refusal("q8", [head]) is None
    assert activations_refusal("f32", [floats]) is None


@needs_q8
def test_int4_and_int8_in_torch_say_that_q8_did_not_apply(q8):
    from moebench.kernels import cpu_dense, int4_torch

    int4_torch._warned.clear()
    w = pack_int4_rows(_matrix(8, 64, seed=5))
    with pytest.warns(RuntimeWarning, match="q8 ACTIVATIONS NOT APPLIED"):
        cpu_dense.torch_linear(torch.randn(40, 64), w)  # prefill rows: torch, float32 activations
    with pytest.warns(RuntimeWarning, match="the fused MoE op in torch"):
        from moebench.kernels.cpu_moe import fused_moe_cpu_torch

        fused_moe_cpu_torch(torch.randn(2, 64), torch.rand(2, 1), torch.tensor([[0], [1]]),
                            pack_int4_rows(_matrix(2, 64, 64, seed=6)), pack_int4_rows(_matrix(2, 64, 32, seed=7)))
    w8 = pack_int8_rows(_matrix(8, 64, seed=5))
    with pytest.warns(RuntimeWarning, match="runs int8 weights in torch with float32 activations"):
        cpu_dense.torch_linear(torch.randn(40, 64), w8)
    head, scale = quantize_lm_head(_matrix(8, 64, seed=8), "int8")
    with pytest.warns(RuntimeWarning, match="the LM head of prefill rows runs int8 weights"):
        cpu_dense.torch_lm_head(torch.randn(40, 64), head, scale)
    ext.set_activations("f32")
    int4_torch._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_dense.torch_linear(torch.randn(40, 64), w)  # f32 activations asked for: nothing to say
        cpu_dense.torch_linear(torch.randn(40, 64), w8)


def test_a_failed_rounds_nan_does_not_make_the_cells_median_nan():
    # the q8 two-thread batch-1 cell of docs/int4.md: one round's decode rate by subtraction was nan
    from moebench.measuring.bench_engine import _median

    assert _median([230.5, float("nan"), 200.0]) == 215.25
    assert _median([float("nan")]) != _median([float("nan")])  # nothing measured: nan


def test_bench_engine_takes_q8_where_an_int4_or_int8_row_meets_it_and_refuses_it_elsewhere():
    from moebench.measuring.bench_engine_q8 import with_activations

    for weights, lm_head in (("int4", "f32"), ("int8", "f32"), ("f32", "int8")):
        assert with_activations(Overrides(), "q8", weights, lm_head).activations == "q8"
    for lm_head in ("f32", "bf16", "fp8"):  # no int4 or int8 row anywhere: q8 would do nothing
        with pytest.raises(MoebenchError, match="only int4 and int8 rows have q8 kernels"):
            with_activations(Overrides(), "q8", "f32", lm_head)
    assert with_activations(Overrides(), None, "f32").activations == "f32"


@pytest.mark.parametrize("command", [["run", "--limit", "3"], ["serve", "--port", "0"]])
def test_q8_with_no_int_rows_is_one_line_before_anything_loads(tmp_path, command):
    import os
    import subprocess
    import sys

    out = tmp_path / "results"
    args = command + (["--out", str(out)] if command[0] == "run" else [])
    r = subprocess.run([sys.executable, "-m", "moebench", *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MOEBENCH_ACTIVATIONS": "q8"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "moebench: error: MOEBENCH_ACTIVATIONS=q8: no config of this run streams int4 or int8 rows")
    assert "Traceback" not in r.stderr
    assert not out.exists() or not any(out.iterdir())  # no run folder claimed
