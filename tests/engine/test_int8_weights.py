"""8-bit weights (--weights int8): the packed rows, the dense and fused MoE kernels against their torch
references, the engine on its three decode paths with its evidence, the stores, and the ablation axis."""

import pytest
import torch

from moebench.ablation import ablation_matrix, parse_axes
from moebench.engine.quantize import int8_rows, pack_int8_rows, quantize_lm_head
from moebench.errors import MoebenchError
from moebench.kernels.cpu_moe import load_extension
from moebench.kernels.reference import moe_reference, rows_linear_reference, unpack_int8_rows

ext = load_extension()
needs_ext = pytest.mark.skipif(ext is None or not hasattr(ext, "weight_stats"), reason="the C++ extension did not build")


def _matrix(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3  # rows of unequal range


def _bound(x, w):
    """A float32 rounding bound for x @ dequantized(w).T summed in any order."""
    values, scale = unpack_int8_rows(w)
    return 1e-5 * x.shape[1] ** 0.5 * (x.abs().float() @ values.float().abs().T) * scale + 1e-6


def test_packed_rows_hold_the_int8_values_and_their_scale():
    w = _matrix(3, 5, 12, seed=1)
    w[0, 0] = 0  # an all-zero row gets scale 1
    packed = pack_int8_rows(w)
    assert packed.dtype == torch.int8 and packed.shape == (3, 5, 20)
    values, scale = unpack_int8_rows(packed)
    q, s = int8_rows(w)
    assert torch.equal(values, q) and torch.equal(scale, s) and scale[0, 0] == 1
    assert (values.abs() <= 127).all() and (values.abs().amax(-1)[w.abs().amax(-1) > 0] == 127).all()
    assert ((values.float() * scale[..., None] - w).abs() <= scale[..., None] / 2 + 1e-6).all()
    assert not packed[..., 16:].any()  # the padding
    # the LM head's int8 quantizer is the same rounding (one quantizer, two layouts)
    head_q, head_s = quantize_lm_head(w[1], "int8")
    assert torch.equal(head_q, q[1]) and torch.equal(head_s, s[1])
    with pytest.raises(MoebenchError):
        pack_int8_rows(torch.ones(2, 6))  # rows the kernels cannot align


@needs_ext
@pytest.mark.parametrize("rows,cols,tokens", [(1, 8, 1), (7, 12, 2), (64, 64, 3), (100, 96, 4), (257, 200, 5),
                                             (300, 1028, 16), (130, 40, 32)])
def test_dense_kernel_matches_the_reference(rows, cols, tokens):
    w = pack_int8_rows(_matrix(rows, cols, seed=rows + cols))
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    bias = torch.randn(rows)
    got = ext.dense_linear(x, w, bias)
    want = rows_linear_reference(x, w) + bias
    assert ((got - want).abs() <= _bound(x, w) + 1e-5 * bias.abs()).all(), (got - want).abs().max()


@needs_ext
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 4), (16, 2), (40, 3)])
def test_fused_moe_kernel_matches_the_reference(tokens, top_k):
    E, H, I = 7, 64, 40
    w13 = pack_int8_rows(_matrix(E, 2 * I, H, seed=2))
    w2 = pack_int8_rows(_matrix(E, H, I, seed=3))
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    want = moe_reference(x, weights, ids, w13, w2)
    got = ext.fused_moe(x, weights, ids, w13, w2)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max()), (got - want).abs().max()
    # a pool's slots (a view of a larger buffer), as an expert store hands them in
    pool13, pool2 = torch.cat([w13, w13]), torch.cat([w2, w2])
    assert torch.equal(ext.fused_moe(x, weights, ids + E, pool13, pool2), got)
    # the quantization is approximate, not wrong: close to the float32 layer
    full = moe_reference(x, weights, ids, _matrix(E, 2 * I, H, seed=2), _matrix(E, H, I, seed=3))
    assert (got - full).norm() < 0.05 * full.norm()


@needs_ext
def test_the_kernels_count_what_they_streamed():
    w = pack_int8_rows(_matrix(64, 32, seed=4))
    before = ext.weight_stats()["dense"].get("int8", {"calls": 0, "bytes": 0})
    ext.dense_linear(torch.randn(2, 32), w)
    after = ext.weight_stats()["dense"]["int8"]
    assert after["calls"] - before["calls"] == 1 and after["bytes"] - before["bytes"] == 64 * 40


# ------------------------------------------------------------------ the engine


def _tiny(tmp_path):
    from tiny_models import make_tiny_checkpoint

    from moebench.engine import load_checkpoint

    return load_checkpoint(make_tiny_checkpoint(tmp_path / "m", "qwen3_e6_k2_norm", hidden_size=64, head_dim=16))


def _generate(ckpt, **runtime):
    from moebench.engine import Engine, Request, RuntimeConfig

    prompts = torch.randint(1, ckpt.config.vocab_size, (5, 9), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(ckpt, None, RuntimeConfig(max_new_tokens=6, batch_size=5, **runtime))
    return engine.generate([Request(f"r{i}", "", 6) for i in range(5)], prompt_ids=prompts)


@needs_ext
def test_engine_streams_int8_on_every_decode_path_and_says_so(tmp_path):
    ckpt = _tiny(tmp_path)
    outputs = {}
    for kernel, path in (("naive", "eager"), ("fused", "chained"), ("fused", "native")):
        result = _generate(ckpt, kernel=kernel, decode_path=path, weights="int8")
        assert not result.activation_errors, result.activation_errors
        ev = result.evidence["weights"]
        assert ev["precision"] == "int8" and ev["held"] == {"dense": "int8", "experts": "int8"}
        assert ev["kernel"]["dense"]["int8"]["bytes"] > 0
        if kernel == "fused":  # the routed experts streamed as int8 rows, nothing wider
            assert set(ev["kernel"]["experts"]) == {"int8"}
        assert result.evidence["prefetch"]["expert_dtype"] == "int8"
        outputs[(kernel, path)] = [c.output_ids for c in result.completions]
    # the same rows, one rounding: every path gives the same greedy tokens on this small model
    assert outputs[("fused", "chained")] == outputs[("fused", "native")] == outputs[("naive", "eager")]
    # and the checkpoint itself is untouched: the float weights run as before, with float evidence
    full = _generate(ckpt, kernel="fused", decode_path="native")
    assert full.evidence["weights"]["precision"] == "f32" and "int8" not in full.evidence["weights"]["kernel"]["dense"]
    assert ckpt.layers[0].qkv_proj.dtype == torch.float32


@needs_ext
def test_offloaded_int8_experts_load_into_int8_slots(tmp_path):
    ckpt = _tiny(tmp_path)
    resident = _generate(ckpt, kernel="fused", weights="int8")
    offloaded = _generate(ckpt, kernel="fused", weights="int8", expert_budget=0.5, offload_tier="disk")
    assert not offloaded.activation_errors
    store = offloaded.evidence["prefetch"]
    assert store["expert_dtype"] == "int8" and store["expert_misses"] > 0
    # one expert's int8 rows and scales: 2I (H + 8) + H (I + 8) bytes, a quarter of float32's and a little
    cfg = ckpt.config
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert store["expert_pool_bytes"] % (2 * I * (H + 8) + H * (I + 8)) == 0
    assert [c.output_ids for c in offloaded.completions] == [c.output_ids for c in resident.completions]


def test_weights_int8_is_refused_where_it_cannot_run():
    from moebench.engine import RuntimeConfig

    with pytest.raises(MoebenchError):
        RuntimeConfig(weights="int3")
    with pytest.raises(MoebenchError):
        RuntimeConfig(weights="int8", device="cuda")


def test_an_int8_config_whose_kernels_streamed_float_is_an_activation_error():
    from moebench.engine.weight_evidence import weights_errors

    evidence = {"precision": "int8", "held": {"dense": "float32", "experts": "float32"},
                "kernel": {"dense": {"float32": {"calls": 3, "bytes": 10}}, "experts": {"float32": {"calls": 1, "bytes": 9}}},
                "torch": {}}
    errors = weights_errors(evidence, "float32")
    assert len(errors) == 5, errors
    assert weights_errors(dict(evidence, kernel={"dense": {}, "experts": {}}, held={})) == [
        "--weights int8: no projection ran with int8 weights"]
    assert weights_errors(dict(evidence, precision="f32"), "float32") == []


def test_weights_axis_is_approximate():
    assert parse_axes("weights") == ((), {"weights"})
    names = [c.name for c in ablation_matrix(("kernel",), weights=("int8",))]
    assert names == ["baseline", "kernel", "weights=int8", "kernel+weights=int8"]
    config = ablation_matrix((), weights=("int8",))[1]
    assert config.to_dict() == {"name": "weights=int8", "kernel": "naive", "scheduler": "static", "prefetch": "off",
                                "weights": "int8", "approximate": True}


def test_a_run_with_int8_configs_offloads_every_config_to_the_same_tier(capsys):
    """int8 experts cannot come from disk; the baseline must not either, or the weights switch would
    also change the tier its speedup is measured against."""
    from moebench.engine import RuntimeConfig
    from moebench.measuring.run import _one_tier_for_every_config

    with_int8 = ablation_matrix((), weights=("int8",))
    assert _one_tier_for_every_config(RuntimeConfig(offload_tier="disk"), with_int8).offload_tier == "host"
    assert "weights=int8" in capsys.readouterr().err
    without = ablation_matrix(("kernel",))
    assert _one_tier_for_every_config(RuntimeConfig(offload_tier="disk"), without).offload_tier == "disk"
