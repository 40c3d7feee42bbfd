"""The engine's greedy pick is torch's argmax, index for index: ties to the first index, NaN largest."""

import torch

from moebench.engine.sampling import greedy_token_ids


def test_greedy_ids_are_torch_argmax_with_ties_and_nan():
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 16):
        for vocab in (7, 32000):
            logits = torch.randn(rows, vocab, generator=g)
            if vocab > 8:
                logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a tie: the first one wins
                logits[-1, 6] = float("nan")  # NaN beats every number
                logits[-1, 2] = float("nan")
            expected = logits.argmax(dim=-1).tolist()
            assert greedy_token_ids(logits) == expected
            assert greedy_token_ids(logits[:, : vocab // 2 + 1]) == logits[:, : vocab // 2 + 1].argmax(dim=-1).tolist()
    assert greedy_token_ids(torch.tensor([[1.0, 3.0, 3.0]], dtype=torch.bfloat16)) == [1]
