"""Triton kernels (fused MoE GEMMs, routing) against the references.

On CPU they run through Triton's interpreter, which is chosen when `triton` is first
imported (TRITON_INTERPRET=1 must be set before that, and stay set). Other test modules may
import triton first, so the outer pytest process runs this file again in a subprocess with the
variable set (`test_triton_kernels_interpreted`). With TRITON_INTERPRET=1 already set, the
tests run directly on CPU tensors; on a CUDA machine they also run natively on the GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repo_paths import REPO

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)


def test_triton_kernels_interpreted():
    if INTERPRET:
        pytest.skip("this process already runs the kernels interpreted")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"interpreted Triton tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


if DEVICE is not None:
    pytest.importorskip("triton")
    from moebench.kernels import moe_reference, route_grouped_sigmoid, route_softmax_topk, routing, triton_moe
    from moebench.kernels.tuning import default_config

    def make_case(n, e, k, h_dim, inter, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, h_dim, generator=g)
        w13 = torch.randn(e, 2 * inter, h_dim, generator=g) * h_dim**-0.5
        w2 = torch.randn(e, h_dim, inter, generator=g) * inter**-0.5
        logits = torch.randn(n, e, generator=g)
        if e > k + 2:
            logits[:, ::4] = -1e4  # some experts get no tokens
        weights, ids = route_softmax_topk(logits, k, True)
        return tuple(t.to(DEVICE) for t in (x, weights, ids, w13, w2))

    def assert_close_to_reference(out, ref, tol=1e-4):
        scale = ref.abs().max().item()
        err = (out - ref).abs().max().item()
        assert err <= tol * max(scale, 1e-6), f"max abs diff {err:.3g} vs output scale {scale:.3g}"

    # (tokens, experts, top_k, hidden, width): small odd shapes, every token count, expert count
    # and top-k of the CPU grid at least once; widths not multiples of the blocks (masking).
    MOE_CASES = [
        (1, 7, 1, 40, 24),
        (3, 16, 2, 33, 20),
        (17, 60, 8, 24, 18),
        (64, 16, 8, 16, 16),
        (17, 7, 2, 48, 40),
        (3, 60, 8, 20, 12),
    ]

    @pytest.mark.parametrize("n,e,k,h_dim,inter", MOE_CASES)
    def test_fused_moe_triton_matches_reference(n, e, k, h_dim, inter):
        x, weights, ids, w13, w2 = make_case(n, e, k, h_dim, inter, seed=n * 7 + e)
        out = triton_moe.fused_moe_triton(x, weights, ids, w13, w2)
        assert_close_to_reference(out, moe_reference(x, weights, ids, w13, w2))

    def test_fused_moe_triton_block_configs_and_strided_pool():
        x, weights, ids, w13, w2 = make_case(9, 6, 2, 40, 20, seed=3)
        ref = moe_reference(x, weights, ids, w13, w2)
        pool13 = torch.zeros(2 * 20, 8, 40, device=DEVICE).transpose(0, 1)  # rows of an expert not adjacent
        pool13[1:7] = w13
        cfg = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2}
        out = triton_moe.fused_moe_triton(x, weights, ids + 1, pool13, torch.cat([w2[:1], w2, w2[:1]]), cfg)
        assert_close_to_reference(out, ref)

    def test_default_config_scales_with_rows_per_expert():
        assert default_config(1, 8, 128)["BLOCK_SIZE_M"] == 16
        assert default_config(4096, 8, 128)["BLOCK_SIZE_M"] == 64

    @pytest.mark.parametrize("n,e,k,renorm", [(1, 7, 1, True), (3, 16, 2, False), (17, 60, 8, True), (4, 8, 8, True)])
    def test_softmax_topk_triton(n, e, k, renorm):
        g = torch.Generator().manual_seed(n + e)
        logits = torch.randn(n, e, generator=g).to(DEVICE)
        logits[0, : min(e, 4)] = 2.0  # a four-way tie at the top
        if n > 2:
            logits[2] = 0.0  # all equal
        w, ids = routing.softmax_topk_triton(logits, k, renorm)
        rw, rids = route_softmax_topk(logits, k, renorm)
        assert torch.equal(ids, rids)
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)

    GROUPED_CASES = [
        # n, experts, top_k, n_group, topk_group, bias
        (3, 16, 2, 4, 2, True),
        (17, 64, 8, 8, 4, True),
        (2, 8, 1, 1, 1, False),  # no groups
        (4, 12, 3, 3, 3, True),  # all groups kept
        (5, 12, 4, 6, 2, False),
        (3, 7, 2, 7, 3, True),  # one expert per group: a group scores its only expert
    ]

    @pytest.mark.parametrize("n,e,k,ng,tg,has_bias", GROUPED_CASES)
    def test_grouped_sigmoid_triton(n, e, k, ng, tg, has_bias):
        g = torch.Generator().manual_seed(e * 3 + k)
        logits = torch.randn(n, e, generator=g).to(DEVICE)
        bias = (torch.randn(e, generator=g) * 0.3).to(DEVICE) if has_bias else None
        logits[0] = 0.0  # ties everywhere in the first row (groups and experts)
        w, ids = routing.grouped_sigmoid_triton(logits, bias, k, ng, tg, True, 2.5)
        rw, rids = route_grouped_sigmoid(logits, bias, k, ng, tg, True, 2.5)
        assert torch.equal(ids, rids)
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)

    def test_grouped_sigmoid_triton_group_ties_and_negative_scores():
        # Groups tie on their top-2 sums; biased scores are all negative.
        logits = torch.zeros(2, 8, device=DEVICE)
        bias = torch.tensor([-1.0, -1.0, -1.0, -1.0, -2.0, -2.0, -1.0, -1.0], device=DEVICE)
        for tg in (1, 2, 3):
            w, ids = routing.grouped_sigmoid_triton(logits, bias, 2, 4, tg, False, 1.0)
            rw, rids = route_grouped_sigmoid(logits, bias, 2, 4, tg, False, 1.0)
            assert torch.equal(ids, rids)
            assert ids[0].tolist() == [0, 1]
            torch.testing.assert_close(w, rw)
