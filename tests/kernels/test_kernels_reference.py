"""The plain PyTorch references: checked against independent formulations and hand cases."""

import pytest
import torch
import torch.nn.functional as F

from moebench.kernels import moe_reference, route_grouped_sigmoid, route_softmax_topk
from moebench.kernels.align import max_padded_pairs, moe_align_block_size, sort_by_expert


def hf_style_moe(x, topk_weights, topk_ids, w13, w2):
    """Hugging Face's formulation: one-hot mask over all experts, scanned per expert."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids, w13.shape[0]).permute(2, 1, 0)  # [E, k, N]
    for e in range(w13.shape[0]):
        slot, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        h = F.silu(x[tok] @ w13[e, :inter].T) * (x[tok] @ w13[e, inter:].T)
        out.index_add_(0, tok, (h @ w2[e].T) * topk_weights[tok, slot, None])
    return out


@pytest.mark.parametrize("n,e,k", [(1, 7, 1), (3, 16, 2), (17, 60, 8), (64, 16, 8)])
def test_moe_reference_matches_hf_formulation(n, e, k):
    g = torch.Generator().manual_seed(n * 100 + e)
    h_dim, inter = 24, 20
    x = torch.randn(n, h_dim, generator=g)
    w13 = torch.randn(e, 2 * inter, h_dim, generator=g)
    w2 = torch.randn(e, h_dim, inter, generator=g)
    weights, ids = route_softmax_topk(torch.randn(n, e, generator=g), k, True)
    ref = moe_reference(x, weights, ids, w13, w2)
    torch.testing.assert_close(ref, hf_style_moe(x, weights, ids, w13, w2), rtol=1e-5, atol=1e-5)


def test_moe_reference_empty_and_dtype():
    x = torch.randn(0, 8)
    out = moe_reference(x, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), torch.randn(4, 6, 8), torch.randn(4, 8, 3))
    assert out.shape == (0, 8)
    xb = torch.randn(2, 8, dtype=torch.bfloat16)
    w13 = torch.randn(4, 6, 8, dtype=torch.bfloat16)
    w2 = torch.randn(4, 8, 3, dtype=torch.bfloat16)
    out = moe_reference(xb, torch.rand(2, 2), torch.tensor([[0, 3], [3, 1]]), w13, w2)
    assert out.dtype == torch.bfloat16


def test_softmax_topk_renormalize_and_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    w, ids = route_softmax_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]  # ties: the lower index first
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(w, p.gather(1, ids))
    w, _ = route_softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    assert w.dtype == torch.float32 and ids.dtype == torch.int64


def test_softmax_topk_input_dtype_is_upcast():
    logits = torch.randn(5, 9).bfloat16()
    w, ids = route_softmax_topk(logits, 3, True)
    w32, ids32 = route_softmax_topk(logits.float(), 3, True)
    assert torch.equal(ids, ids32) and w.dtype == torch.float32


def test_grouped_sigmoid_group_limit_by_hand():
    # 8 experts in 4 groups of 2. Biased scores decide the groups; unbiased ones weight.
    logits = torch.tensor([[0.0, 0.0, 3.0, -3.0, 1.0, 1.0, -2.0, 2.5]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    s = torch.sigmoid(logits[0])
    group_scores = [s[0] + s[1], s[2] + s[3], s[4] + s[5], s[6] + s[7]]
    assert int(torch.stack(group_scores).argmax()) == 2  # group 2 (experts 4, 5) is best
    w, ids = route_grouped_sigmoid(logits, bias, 2, 4, 1, False, 1.0)
    # Only group 2 survives, so expert 2 (the best single score) cannot be chosen.
    assert ids.tolist() == [[4, 5]]
    torch.testing.assert_close(w[0], s[[4, 5]])
    # Two groups: 2 and then 3 (s6 + s7 > s2 + s3); the top-2 experts among {4,5,6,7}.
    w, ids = route_grouped_sigmoid(logits, bias, 2, 4, 2, True, 2.5)
    assert ids.tolist() == [[7, 4]]
    torch.testing.assert_close(w[0], s[[7, 4]] / s[[7, 4]].sum() * 2.5)


def test_grouped_sigmoid_bias_selects_but_does_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = route_grouped_sigmoid(logits, bias, 1, 1, 1, False, 1.0)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[-1.0]])))


def test_grouped_sigmoid_negative_biased_scores_never_pick_masked_experts():
    # All biased scores are negative; masking the dropped groups with 0 (not -inf) would
    # wrongly pick experts from them.
    logits = torch.zeros(1, 8)
    bias = torch.tensor([-1.0, -1.0, -2.0, -2.0, -3.0, -3.0, -4.0, -4.0])
    _, ids = route_grouped_sigmoid(logits, bias, 2, 4, 1, True, 1.0)
    assert ids.tolist() == [[0, 1]]


def test_grouped_sigmoid_ties_lowest_index_wins():
    logits = torch.zeros(2, 12)
    _, ids = route_grouped_sigmoid(logits, None, 4, 4, 2, True, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    w, _ = route_grouped_sigmoid(logits, None, 4, 4, 2, True, 1.0)
    torch.testing.assert_close(w, torch.full((2, 4), 0.25))


def test_grouped_sigmoid_without_groups_is_plain_topk():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.1
    w, ids = route_grouped_sigmoid(logits, bias, 4, 1, 1, False, 1.0)
    expect = torch.topk(torch.sigmoid(logits) + bias, 4).indices
    assert torch.equal(ids, expect)


def test_sort_by_expert():
    ids = torch.tensor([[3, 0], [0, 2], [3, 3]])
    order, offsets = sort_by_expert(ids, 5)
    assert offsets.tolist() == [0, 2, 2, 3, 6, 6]
    assert order.tolist() == [1, 2, 3, 0, 4, 5]


@pytest.mark.parametrize("block", [1, 4, 16])
def test_moe_align_block_size(block):
    g = torch.Generator().manual_seed(block)
    n, k, e = 9, 3, 7
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    ids[ids == 5] = 4  # expert 5 gets no tokens (duplicates within a row are fine here)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, block, e)
    pairs = n * k
    assert sorted_ids.numel() == max_padded_pairs(pairs, e, block)
    assert sorted_ids.numel() % block == 0 and expert_ids.numel() == sorted_ids.numel() // block
    total = int(num_padded)
    assert total % block == 0
    real = sorted_ids[:total]
    # Every pair exactly once, sentinels only as padding, nothing real past the end.
    assert sorted(real[real < pairs].tolist()) == list(range(pairs))
    assert (sorted_ids[total:] == pairs).all()
    flat = ids.reshape(-1)
    for b in range(total // block):
        chunk = real[b * block : (b + 1) * block]
        chunk = chunk[chunk < pairs]
        assert chunk.numel() > 0, "a block inside the padded length holds no pair"
        assert (flat[chunk.long()] == expert_ids[b]).all()
        assert chunk.tolist() == sorted(chunk.tolist())  # token order kept within an expert
