"""CPU fused MoE (C++ extension and the grouped torch fallback) against the reference."""

import itertools
import shutil

import pytest
import torch

from moebench.kernels import cpu_backend, fused_moe, fused_moe_cpu, moe_reference, route_softmax_topk
from moebench.kernels.build import find_ninja
from moebench.kernels.cpu_moe import BACKEND_CPP, BACKEND_TORCH, fused_moe_cpu_torch, load_extension

TOKENS = [1, 3, 17, 64]
EXPERTS = [7, 16, 60]
TOPK = [1, 2, 8]
GRID = [(n, e, k) for n, e, k in itertools.product(TOKENS, EXPERTS, TOPK) if k <= e]


def make_case(n, e, k, h_dim, inter, seed, dtype=torch.float32, skip_experts=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h_dim, generator=g)
    w13 = torch.randn(e, 2 * inter, h_dim, generator=g) * h_dim**-0.5
    w2 = torch.randn(e, h_dim, inter, generator=g) * inter**-0.5
    logits = torch.randn(n, e, generator=g)
    if skip_experts and e > k + 2:
        logits[:, 1::3] = -1e4  # a third of the experts never receive a token
    weights, ids = route_softmax_topk(logits, k, True)
    return x.to(dtype), weights, ids, w13.to(dtype), w2.to(dtype)


def assert_close_to_reference(out, ref, tol=1e-4):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"max abs diff {err:.3g} vs output scale {scale:.3g}"


def _toolchain_present() -> bool:
    return shutil.which("c++") is not None and find_ninja() is not None and torch.cpu._is_avx2_supported()


@pytest.mark.skipif(not _toolchain_present(), reason="no C++ compiler, ninja or AVX2 here")
def test_extension_builds_where_a_toolchain_exists():
    load_extension()
    assert cpu_backend() == BACKEND_CPP


@pytest.mark.parametrize("n,e,k", GRID)
def test_fused_cpu_matches_reference(n, e, k):
    # Odd widths exercise every remainder path: H % 8 (vector tail), I % 4 and H % 32 row groups.
    h_dim, inter = (71, 22) if (n + e + k) % 2 else (64, 33)
    x, weights, ids, w13, w2 = make_case(n, e, k, h_dim, inter, seed=n * 1000 + e * 10 + k)
    ref = moe_reference(x, weights, ids, w13, w2)
    assert_close_to_reference(fused_moe_cpu(x, weights, ids, w13, w2), ref)
    assert_close_to_reference(fused_moe(x, weights, ids, w13, w2), ref)


@pytest.mark.parametrize("n,e,k", [(1, 7, 2), (17, 16, 8), (64, 60, 8), (3, 60, 1)])
def test_torch_fallback_matches_reference(n, e, k):
    x, weights, ids, w13, w2 = make_case(n, e, k, 40, 24, seed=n + e + k)
    ref = moe_reference(x, weights, ids, w13, w2)
    assert_close_to_reference(fused_moe_cpu_torch(x, weights, ids, w13, w2), ref)


def test_slot_pool_views_and_strides():
    """An expert store passes a pool of slots: views with offsets and unusual strides."""
    n, e, k, h_dim, inter = 9, 6, 2, 48, 20
    x, weights, ids, w13, w2 = make_case(n, e, k, h_dim, inter, seed=5, skip_experts=False)
    ref = moe_reference(x, weights, ids, w13, w2)
    pool13 = torch.zeros(e + 3, 2 * inter, h_dim)
    pool13[2 : e + 2] = w13
    pool2 = torch.zeros(h_dim, e + 1, inter).transpose(0, 1)  # expert stride != H * I
    pool2[:e] = w2
    v13, v2 = pool13[2 : e + 2], pool2[:e]
    assert not v2.is_contiguous()
    assert_close_to_reference(fused_moe_cpu(x, weights, ids, v13, v2), ref)
    assert_close_to_reference(fused_moe_cpu_torch(x, weights, ids, v13, v2), ref)
    # Row-interleaved layout: rows of one expert are not adjacent in memory.
    rows13 = torch.zeros(2 * inter, e, h_dim).transpose(0, 1)
    rows13.copy_(w13)
    assert_close_to_reference(fused_moe_cpu(x, weights, ids, rows13, w2), ref)


def test_strided_activations_and_weight_dtypes():
    n, e, k = 5, 8, 2
    x, weights, ids, w13, w2 = make_case(n, e, k, 32, 16, seed=11)
    wide = torch.zeros(n, 64)
    wide[:, ::2] = x  # last-dim stride 2 must be handled (copied) correctly
    ref = moe_reference(x, weights, ids, w13, w2)
    assert_close_to_reference(fused_moe_cpu(wide[:, ::2], weights, ids, w13, w2), ref)
    # Routing weights in half precision and int32 ids are accepted.
    assert_close_to_reference(fused_moe_cpu(x, weights.half().float(), ids.int(), w13, w2),
                              moe_reference(x, weights.half().float(), ids, w13, w2))


def test_bfloat16():
    x, weights, ids, w13, w2 = make_case(17, 16, 4, 64, 32, seed=2, dtype=torch.bfloat16)
    out = fused_moe_cpu(x, weights, ids, w13, w2)
    assert out.dtype == torch.bfloat16
    # Against float32 math on the same (bfloat16) values; the only difference is output rounding.
    ref = moe_reference(x.float(), weights, ids, w13.float(), w2.float())
    assert_close_to_reference(out.float(), ref, tol=1e-2)
    assert_close_to_reference(fused_moe_cpu_torch(x, weights, ids, w13, w2).float(), ref, tol=3e-2)


@pytest.mark.skipif(not _toolchain_present(), reason="needs the C++ extension")
def test_bfloat16_weights_widen_exactly():
    """float32 activations with bfloat16 weights: the kernel widens each weight in registers, so
    the result is bit-identical to float32 weights holding the same values (why the engine hands
    the fused kernel a bfloat16 checkpoint's experts as they are)."""
    x, weights, ids, w13, w2 = make_case(17, 16, 4, 72, 40, seed=5)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    assert cpu_backend() == BACKEND_CPP
    assert torch.equal(fused_moe_cpu(x, weights, ids, w13, w2), fused_moe_cpu(x, weights, ids, w13.float(), w2.float()))


def test_float16_uses_fallback():
    x, weights, ids, w13, w2 = make_case(3, 7, 2, 16, 8, seed=4)
    out = fused_moe_cpu(x.half(), weights, ids, w13.half(), w2.half())
    assert out.dtype == torch.float16
    assert_close_to_reference(out.float(), moe_reference(x, weights, ids, w13, w2), tol=2e-2)


def test_no_tokens_and_bad_ids():
    w13, w2 = torch.randn(4, 8, 16), torch.randn(4, 16, 4)
    out = fused_moe_cpu(torch.randn(0, 16), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), w13, w2)
    assert out.shape == (0, 16)
    if cpu_backend() == BACKEND_CPP:
        with pytest.raises(RuntimeError, match="out of range"):
            fused_moe_cpu(torch.randn(1, 16), torch.ones(1, 1), torch.tensor([[4]]), w13, w2)


def test_thread_count_does_not_change_results():
    x, weights, ids, w13, w2 = make_case(17, 16, 8, 64, 40, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_moe_cpu(x, weights, ids, w13, w2)
        torch.set_num_threads(max(2, threads))
        many = fused_moe_cpu(x, weights, ids, w13, w2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def _reset_loader(monkeypatch, cm, build):
    """As if nothing had been built yet, with `build` as the builder; restored after the test."""
    monkeypatch.setattr(cm, "_build", build)
    for attr, value in (("module", None), ("tried", False), ("failure", None)):
        monkeypatch.setattr(cm._extension, attr, value)


def test_build_failure_falls_back_with_one_warning(monkeypatch):
    import warnings

    import moebench.kernels.cpu_moe as cm

    def broken():
        raise RuntimeError("no compiler here")

    _reset_loader(monkeypatch, cm, broken)
    x, weights, ids, w13, w2 = make_case(3, 7, 2, 16, 8, seed=1)
    with pytest.warns(RuntimeWarning, match="fallback"):
        out = cm.fused_moe_cpu(x, weights, ids, w13, w2)
    assert_close_to_reference(out, moe_reference(x, weights, ids, w13, w2))
    assert cm.cpu_backend() == cm.BACKEND_TORCH
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        cm.fused_moe_cpu(x, weights, ids, w13, w2)


def test_the_moe_op_override_runs_the_torch_op_and_nothing_else(monkeypatch):
    """moe_op=torch computes the fused MoE op in grouped torch ops, as its evidence says, and is
    accepted by the activation check; the extension's other ops are not its business."""
    import moebench.kernels.cpu_moe as cm
    from moebench.engine.moe import kernel_activation_errors, make_kernel
    from moebench.engine.overrides import Overrides

    x, weights, ids, w13, w2 = make_case(3, 7, 2, 16, 8, seed=1)
    kernel = make_kernel("fused", Overrides(moe_op="torch"))
    built = []
    monkeypatch.setattr(cm, "load_extension", lambda: built.append(1))
    torch.testing.assert_close(kernel(x, weights, ids, w13, w2), moe_reference(x, weights, ids, w13, w2))
    assert built == [] and kernel.evidence()["backends"] == {cm.BACKEND_TORCH: 1}
    assert kernel_activation_errors("fused", kernel.evidence()) == []
    default = make_kernel("fused").evidence()
    assert cm.BACKEND_TORCH not in default["allowed_backends"]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("kernel,dtype", [("fused", torch.float32), ("fused", torch.bfloat16),
                                          ("torch", torch.float32), ("naive", torch.float32)])
def test_slot_order_does_not_change_bits(kernel, dtype, k):
    """An offloaded run puts experts in whatever slots the store picked; a token's contributions
    must add to the same bits whatever the slots: in rank order, with no fused multiply-add
    contraction of the products."""
    g = torch.Generator().manual_seed(0)
    E, H, I, N = 16, 64, 48, 12
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(dtype)
    x = torch.randn(N, H, generator=g)
    weights, ids = torch.topk(torch.randn(N, E, generator=g).softmax(-1), k)
    perm = torch.randperm(E, generator=g)  # slot s holds expert perm[s]
    slot_of = torch.empty(E, dtype=torch.long)
    slot_of[perm] = torch.arange(E)
    moe = {"fused": fused_moe_cpu, "torch": fused_moe_cpu_torch, "naive": moe_reference}[kernel]
    assert torch.equal(moe(x, weights, ids, w13, w2), moe(x, weights, slot_of[ids], w13[perm], w2[perm]))


def test_fused_moe_counts_the_implementation_that_computed_each_call():
    """`fused_moe` is the one dispatcher of the fused op: it says which implementation ran each call
    (the engine's activation evidence), the C++ kernel where it takes the weights, else the fallback."""
    x, weights, ids, w13, w2 = make_case(3, 7, 2, 16, 8, seed=5)
    backends = {}
    fused_moe(x, weights, ids, w13, w2, backends=backends)
    assert backends == {cpu_backend(): 1}
    fused_moe(x.half(), weights, ids, w13.half(), w2.half(), backends=backends)  # not a dtype the C++ kernel takes
    assert backends.get(BACKEND_TORCH) == 1 and sum(backends.values()) >= 2


@pytest.mark.parametrize("k,renormalize", [(1, True), (2, True), (3, True), (8, True), (3, False)])
def test_route_on_cpu_is_the_reference_bit_for_bit(monkeypatch, k, renormalize):
    """`route` is the one dispatcher of the router: on CPU float32 logits it runs the extension's top-k,
    which gives the reference's weights and ids bit for bit; other dtypes run the reference."""
    from moebench.kernels import cpu_routing, route

    ext = load_extension()
    if ext is None:
        pytest.skip("the CPU extension is not available")
    calls = []

    class Counting:
        def route_topk(self, *args):
            calls.append(args[1])
            return ext.route_topk(*args)

    monkeypatch.setattr(cpu_routing, "load_extension", lambda: Counting())
    logits = torch.randn(17, 60, generator=torch.Generator().manual_seed(k))
    logits[:, 5] = logits[:, 9]  # ties go to the lower index
    w, ids = route(logits, k, renormalize)
    expect_w, expect_ids = route_softmax_topk(logits, k, renormalize)
    assert calls == [k] and torch.equal(ids, expect_ids) and torch.equal(w, expect_w)
    w, ids = route(logits.bfloat16(), k, renormalize)
    assert calls == [k] and torch.equal(ids, route_softmax_topk(logits.bfloat16(), k, renormalize)[1])
