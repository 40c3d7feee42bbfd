"""What token selection costs per decode step: greedy (the engine's argmax path) against the sampler
(engine/sampling.py) with temperature only, top-k and top-p, on random float32 logits.

    python benchmarks/sampler_cost.py --rows 16 --vocab 766 32000 --steps 200

Prints the median milliseconds per step (one call for all rows) of interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, nargs="+", default=[766, 32000])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import numpy as np
    import torch

    from moebench.engine.sampling import greedy_token_ids
    from moebench.engine.sampling import SamplingParams, sample_token_ids

    torch.set_num_threads(1)
    cases = {"greedy": None, "t=0.6": SamplingParams(0.6, seed=1), "t=0.6 top-k 50": SamplingParams(0.6, top_k=50, seed=1),
             "t=0.6 top-p 0.95": SamplingParams(0.6, top_p=0.95, seed=1)}
    for vocab in args.vocab:
        # logits shaped like a language model's: a few likely tokens over a long tail
        rng = np.random.default_rng(vocab)
        logits = torch.tensor(rng.gumbel(size=(args.rows, vocab)) * 2.0, dtype=torch.float32)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, params in cases.items():
                start = time.perf_counter()
                for step in range(args.steps):
                    if params is None:
                        greedy_token_ids(logits)
                    else:
                        sample_token_ids(logits, [params] * args.rows, [step] * args.rows)
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        row = ", ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items())
        print(f"{args.rows} rows x vocab {vocab}: ms per step: {row}")


if __name__ == "__main__":
    main()
