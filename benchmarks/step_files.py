"""Which Python files of the package one decode step runs code in, and how many calls each.

    python benchmarks/step_files.py [--decode-path native|chained|eager] [--kernel fused|naive]
                                    [--budget 1.0] [--batch 4] [--functions] [--time-rounds R]

Runs the bundled model, lets a few steps pass, then records every Python function call of the
package (sys.setprofile) during one decode step of the engine session: the files a reader must
follow to understand that step (docs/architecture.md lists them). `--time-rounds R` instead times
R sessions' decode steps at the full batch, unprofiled (the median step, its forward and the rest),
to check that a change to the step's Python did not slow it: run it for two trees in turn.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path


def files_of_one_step(decode_path: str, kernel: str, budget: float, batch: int) -> tuple[Counter, Counter, dict]:
    import torch

    from moebench.models.bundled import bundled_model_path
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.sequence import Sequence

    ckpt = load_checkpoint(bundled_model_path(), dtype=torch.float32, experts_in_checkpoint_dtype=True)
    rt = RuntimeConfig(kernel=kernel, decode_path=decode_path, expert_budget=budget, batch_size=batch,
                       max_new_tokens=16, offload_tier="host")
    engine = Engine(ckpt, None, rt)
    session = engine.session(64)
    for i in range(batch):
        session.add(Sequence(Request(f"r{i}", "", 16), [5 + i, 6, 7], 16, time.perf_counter()))
    for _ in range(3):  # the prefill and two decode steps: everything built on first use is built
        session.step()
    roots = {str(Path(p).resolve()) for p in _package_dirs()}
    calls: Counter = Counter()
    functions: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if any(f.startswith(r) for r in roots):
                calls[f] += 1
                functions[(f, frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    try:
        record = session.step()
    finally:
        sys.setprofile(None)
    assert record.phase == "decode", record.phase
    session.close()
    return calls, functions, session.evidence()["decode_path"]


def time_steps(decode_path: str, kernel: str, budget: float, batch: int, rounds: int) -> dict:
    """Median milliseconds of a decode step at the full batch over `rounds` sessions of 64-token
    requests: the whole step (duration_s), its forward (forward_s) and the rest of the step."""
    import statistics

    import torch

    from moebench.models.bundled import bundled_model_path
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.sequence import Sequence

    ckpt = load_checkpoint(bundled_model_path(), dtype=torch.float32, experts_in_checkpoint_dtype=True)
    rt = RuntimeConfig(kernel=kernel, decode_path=decode_path, expert_budget=budget, batch_size=batch,
                       max_new_tokens=64, offload_tier="host")
    engine = Engine(ckpt, None, rt)
    steps = []
    for r in range(rounds + 1):  # the first session warms up
        session = engine.session(80)
        for i in range(batch):
            session.add(Sequence(Request(f"r{i}", "", 64), [5 + i + r, 6, 7], 64, time.perf_counter()))
        records = []
        while session.has_work():
            records.append(session.step().to_dict())
        session.close()
        if r:
            steps += [s for s in records if s["phase"] == "decode" and s["batch_size"] == batch]
    if not steps:
        raise SystemExit("no decode step ran at the full batch")
    ms = lambda xs: statistics.median(xs) * 1000
    return {"steps": len(steps), "step_ms": ms([s["duration_s"] for s in steps]),
            "forward_ms": ms([s["forward_s"] for s in steps]),
            "rest_ms": ms([s["duration_s"] - s["forward_s"] for s in steps])}


def _package_dirs() -> list[Path]:
    import moebench
    import moebench.engine
    import moebench.kernels
    import moebench.suites

    return [Path(m.__file__).parent for m in (moebench, moebench.engine, moebench.kernels, moebench.suites)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-path", default="native")
    ap.add_argument("--kernel", default="fused")
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--functions", action="store_true", help="also list the functions called in each file")
    ap.add_argument("--time-rounds", type=int, default=0, help="time decode steps over this many sessions instead")
    args = ap.parse_args(argv)
    if args.time_rounds:
        t = time_steps(args.decode_path, args.kernel, args.budget, args.batch, args.time_rounds)
        print(f"{t['steps']} decode steps at batch {args.batch}: median step {t['step_ms']:.3f} ms, "
              f"forward {t['forward_ms']:.3f} ms, rest {t['rest_ms']:.3f} ms")
        return 0
    calls, functions, path = files_of_one_step(args.decode_path, args.kernel, args.budget, args.batch)
    root = Path(__file__).resolve().parents[1]
    print(f"decode path {path['path']} (kernel={args.kernel}, budget {args.budget}, batch {args.batch}): "
          f"{len(calls)} files, {sum(calls.values())} Python calls")
    for f, n in calls.most_common():
        print(f"  {n:5d}  {Path(f).resolve().relative_to(root) if Path(f).resolve().is_relative_to(root) else f}")
        if args.functions:
            for (g, name), m in functions.most_common():
                if g == f:
                    print(f"         {m:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
