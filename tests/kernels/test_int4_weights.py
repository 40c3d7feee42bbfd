"""4-bit weights (--weights int4): the quantizer against gguf's Q4_0, the reference, the torch path and
its warning, the engine with its evidence, the stores, the ablation axis and the q4_0 GGUF export."""

import warnings

import numpy as np
import pytest
import torch

from moebench.ablation import ablation_matrix
from moebench.engine.quantize import pack_int4_rows, packed_columns
from moebench.errors import MoebenchError
from moebench.kernels import int4_torch
from moebench.kernels.reference import (dequantize_int4_rows, moe_reference, rows_linear_reference, stored_columns,
                                        stored_width, unpack_int4_rows)

gguf = pytest.importorskip("gguf")


def _matrix(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3  # rows of unequal range


def _awkward(rows=5, blocks=3):
    """Rows whose blocks hit Q4_0's corners: all zero, a tie of +m and -m, a lone value, bfloat16 values."""
    w = _matrix(rows, 32 * blocks, seed=7)
    w[0, :32] = 0
    w[1, :32] = 0.25
    w[1, 5] = -0.25  # equal magnitudes: the first one's sign sets d
    w[2, 32:64] = 0
    w[2, 40] = -3.0
    w[3] = w[3].to(torch.bfloat16).float()
    return w


@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (2, 5, 160), (7, 64)])
def test_the_quantizer_writes_the_bytes_of_gguf_q4_0(shape):
    w = _matrix(*shape, seed=sum(shape))
    if shape == (5, 96):
        w = _awkward()
    packed = pack_int4_rows(w)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 32 * 18)
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(packed.numpy(), theirs)
    # and the reference reads them as gguf's dequantizer does, bit for bit
    assert np.array_equal(dequantize_int4_rows(packed).numpy(),
                          gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.Q4_0))


def test_int4_values_scales_and_their_error():
    w = _awkward()
    values, scale = unpack_int4_rows(pack_int4_rows(w))
    assert values.dtype == torch.int8 and values.shape == w.shape and scale.shape == (5, 3)
    assert values.min() >= -8 and values.max() <= 7
    assert scale[0, 0] == 0 and not dequantize_int4_rows(pack_int4_rows(w))[0, :32].any()
    assert values[1, 0] == -8 and values[1, 5] == 7  # +m is -8 d; -m would be +8 d, clipped to 7 d
    blocks = w.reshape(5, 3, 32)
    d = scale.abs()[..., None]
    err = (dequantize_int4_rows(pack_int4_rows(w)).reshape(5, 3, 32) - blocks).abs()
    # half a step everywhere but the value clipped at +7 d (one step); d's float16 rounding on top
    assert (err <= d * (1 + 2 ** -10) + 8 * d * 2 ** -11 + 1e-7).all()
    assert (err <= d / 2 * (1 + 2 ** -10) + 8 * d * 2 ** -11 + 1e-7).float().mean() > 0.95
    with pytest.raises(MoebenchError):
        pack_int4_rows(torch.ones(2, 48))


def test_stored_width_and_columns():
    for k in (32, 96, 1024):
        assert stored_columns(stored_width(k, torch.uint8), torch.uint8) == k
        assert stored_columns(stored_width(k, torch.int8), torch.int8) == k
        assert stored_width(k, torch.float32) == k
    assert packed_columns(pack_int4_rows(torch.randn(3, 96))) == 96


@pytest.mark.parametrize("rows,cols,tokens", [(1, 32, 1), (7, 96, 2), (33, 160, 3), (130, 64, 17), (5, 32, 40)])
def test_the_torch_path_matches_the_reference_and_says_it_is_slow(rows, cols, tokens):
    from moebench.kernels import cpu_dense

    w = pack_int4_rows(_matrix(rows, cols, seed=rows + cols))
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    bias = torch.randn(rows)
    want = x @ dequantize_int4_rows(w).T
    assert torch.equal(rows_linear_reference(x, w), want)
    int4_torch._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = cpu_dense.torch_linear(x, w, bias)
    assert torch.allclose(got, want + bias, rtol=1e-5, atol=1e-5)
    slow = [str(c.message) for c in caught if "SLOW PATH" in str(c.message)]
    assert slow == ([] if tokens > cpu_dense.DENSE_MAX_ROWS else [slow[0]])  # decode rows only, once


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 4), (16, 2)])
def test_the_fused_torch_fallback_matches_the_reference(tokens, top_k):
    from moebench.kernels.cpu_moe import fused_moe_cpu_torch

    E, H, I = 7, 96, 64
    w13, w2 = pack_int4_rows(_matrix(E, 2 * I, H, seed=2)), pack_int4_rows(_matrix(E, H, I, seed=3))
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    want = moe_reference(x, weights, ids, w13, w2)
    int4_torch._warned.clear()
    with pytest.warns(RuntimeWarning, match="SLOW PATH: the fused MoE op"):
        got = fused_moe_cpu_torch(x, weights, ids, w13, w2)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max())
    # approximate, not wrong: near the float32 layer (each matrix is ~9% off in norm at 4 bits; through
    # SwiGLU and the down projection 30-40% here, where a misread nibble or scale gives over 100%)
    full = moe_reference(x, weights, ids, _matrix(E, 2 * I, H, seed=2), _matrix(E, H, I, seed=3))
    assert (got - full).norm() < 0.5 * full.norm()


# ------------------------------------------------------------------ the engine


def _tiny(tmp_path, tied=False):
    """A Qwen3-MoE whose every matrix's rows are a multiple of 32 wide (int4 groups)."""
    from tiny_models import make_tiny_int4_checkpoint

    from moebench.engine import load_checkpoint

    path = make_tiny_int4_checkpoint(tmp_path / "m", tied)
    return path, load_checkpoint(path)


def _generate(ckpt, **runtime):
    from moebench.engine import Engine, Request, RuntimeConfig

    prompts = torch.randint(1, ckpt.config.vocab_size, (5, 9), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(ckpt, None, RuntimeConfig(max_new_tokens=6, batch_size=5, **runtime))
    return engine.generate([Request(f"r{i}", "", 6) for i in range(5)], prompt_ids=prompts)


def test_engine_holds_int4_and_says_what_ran(tmp_path):
    _, ckpt = _tiny(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        naive = _generate(ckpt, kernel="naive", decode_path="eager", weights="int4")
        offloaded = _generate(ckpt, kernel="naive", decode_path="eager", weights="int4", expert_budget=0.5,
                              offload_tier="disk")
    ev = naive.evidence["weights"]
    assert ev["precision"] == "int4" and ev["held"] == {"dense": "int4", "experts": "int4"}
    assert naive.evidence["prefetch"]["expert_dtype"] == "int4"
    from moebench.kernels.cpu_dense import weight_streams

    if weight_streams(pack_int4_rows(torch.randn(32, 64))):  # a C++ int4 kernel: it must have streamed them
        assert not naive.activation_errors, naive.activation_errors
        assert ev["kernel"]["dense"]["int4"]["bytes"] > 0
    else:  # the slow path ran the decode projections: a failed activation check, not a quiet result
        assert ev["torch"]["int4"] > 0
        assert any("never int4" in e for e in naive.activation_errors), naive.activation_errors
        from moebench.engine.overrides import Overrides

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            accepted = _generate(ckpt, kernel="naive", decode_path="eager", weights="int4",
                                 overrides=Overrides(allow_fallback=True))
        assert not accepted.activation_errors, accepted.activation_errors  # unless the user accepts it
        assert [c.output_ids for c in accepted.completions] == [c.output_ids for c in naive.completions]
    # offloaded int4 experts: the host tier (they exist only in memory), Q4_0 rows in the pool's slots
    store = offloaded.evidence["prefetch"]
    assert store["expert_dtype"] == "int4" and store["expert_misses"] > 0
    H, I = 64, 32
    assert store["expert_pool_bytes"] % (2 * I * (H // 32 * 18) + H * (I // 32 * 18)) == 0
    assert [c.output_ids for c in offloaded.completions] == [c.output_ids for c in naive.completions]
    # the checkpoint itself is untouched
    assert ckpt.layers[0].qkv_proj.dtype == torch.float32


def test_weights_int4_is_a_precision_and_an_approximate_axis_value():
    from moebench.engine import RuntimeConfig

    assert RuntimeConfig(weights="int4").weights == "int4"
    with pytest.raises(MoebenchError):
        RuntimeConfig(weights="int4", device="cuda")
    names = [c.name for c in ablation_matrix(("kernel",), weights=("int4",))]
    assert names == ["baseline", "kernel", "weights=int4", "kernel+weights=int4"]
    assert ablation_matrix((), weights=("int4",))[1].to_dict()["approximate"] is True


def test_int4_refuses_rows_that_are_not_whole_groups(tmp_path):
    from moebench.engine import load_checkpoint
    from moebench.engine.quantize import weights_in
    from tiny_models import make_tiny_checkpoint

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "m"))  # hidden 40: not a multiple of 32
    with pytest.raises(MoebenchError, match="int4: rows of 40 values"):
        weights_in(ckpt, "int4")


# ------------------------------------------------------------------ the q4_0 GGUF


@pytest.mark.parametrize("tied", [False, True])
def test_q4_0_export_holds_the_runtimes_int4_bytes(tmp_path, tied):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    from moebench.engine.quantize import weights_in
    from moebench.models.export_gguf import export_gguf
    from moebench.models.random import write_char_tokenizer

    path, ckpt = _tiny(tmp_path, tied=tied)
    write_char_tokenizer(path, 211)
    out = export_gguf(path, tmp_path / "m.gguf", "q4_0")
    tensors = {t.name: t for t in GGUFReader(str(out)).tensors}
    held = weights_in(ckpt, "int4")
    I, q = ckpt.config.moe_intermediate_size, ckpt.config.num_heads * ckpt.config.head_dim
    for i, layer in enumerate(held.layers):
        want = {"attn_q": layer.qkv_proj[:q], "attn_output": layer.o_proj, "ffn_gate_exps": layer.w13[:, :I],
                "ffn_up_exps": layer.w13[:, I:], "ffn_down_exps": layer.w2}
        for name, rows in want.items():
            t = tensors[f"blk.{i}.{name}.weight"]
            assert t.tensor_type == Q.Q4_0
            assert np.array_equal(np.asarray(t.data).reshape(-1), rows.contiguous().numpy().reshape(-1)), name
        assert tensors[f"blk.{i}.ffn_gate_inp.weight"].tensor_type == Q.F32  # the routers stay float32
    if tied:  # the embeddings are the head, streamed every step: Q8_0 like an int8 head
        assert tensors["token_embd.weight"].tensor_type == Q.Q8_0 and "output.weight" not in tensors
    else:
        assert tensors["token_embd.weight"].tensor_type == Q.F32 and tensors["output.weight"].tensor_type == Q.Q8_0
