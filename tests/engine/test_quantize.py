import torch

from moebench.engine.quantize import quantize_rtn


def test_rtn_int4_has_at_most_16_levels_per_group_and_bounded_error():
    w = torch.randn(3, 8, 64)
    q = quantize_rtn(w, bits=4, group_size=32)
    groups = q.reshape(3, 8, 2, 32)
    for g in groups.reshape(-1, 32):
        assert g.unique().numel() <= 16
    scale = w.reshape(3, 8, 2, 32).abs().amax(-1, keepdim=True) / 7
    assert ((q - w).reshape(3, 8, 2, 32).abs() <= scale / 2 + 1e-6).all()
    assert not torch.equal(q, w)
