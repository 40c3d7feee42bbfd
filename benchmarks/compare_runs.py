"""Compare two moebench runs item by item: accuracy of each, identical outputs, discordant pairs and
McNemar's exact p. For configurations measured in different runs (for example the bundled runtime
in-process against llama.cpp's server over HTTP), which `moebench run` itself pairs only within a run.

    python benchmarks/compare_runs.py RUN_A[:CONFIG] RUN_B[:CONFIG] [--trial N] [--trial-b M]

CONFIG defaults to baseline; --trial picks the trial (default 0) so each item is counted once,
--trial-b another trial for RUN_B (default: the same).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moebench.results.stats import mcnemar_exact, wilson_ci


def _samples(spec: str, trial: int) -> tuple[str, dict[str, dict]]:
    run, _, config = spec.partition(":")
    config = config or "baseline"
    rows = {}
    with open(Path(run) / "samples.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row["config"] == config and row["trial"] == trial:
                rows[row["item_id"]] = row
    if not rows:
        raise SystemExit(f"{run}: no samples of config {config!r} in trial {trial}")
    return f"{Path(run).name}:{config}", rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--trial", type=int, default=0)
    parser.add_argument("--trial-b", type=int, default=None)
    args = parser.parse_args()
    name_a, a = _samples(args.a, args.trial)
    name_b, b = _samples(args.b, args.trial if args.trial_b is None else args.trial_b)
    items = sorted(set(a) & set(b))
    only = len(set(a) ^ set(b))
    a_only = sum(a[i]["correct"] and not b[i]["correct"] for i in items)
    b_only = sum(b[i]["correct"] and not a[i]["correct"] for i in items)
    identical = sum(a[i]["output"] == b[i]["output"] for i in items)
    result = {"items": len(items), "items_in_one_run_only": only}
    for name, rows in ((name_a, a), (name_b, b)):
        correct = sum(rows[i]["correct"] for i in items)
        ci = wilson_ci(correct, len(items))
        result[name] = {"correct": correct, "accuracy": round(correct / len(items), 4),
                        "ci95": [round(ci[0], 4), round(ci[1], 4)]}
    result.update({"discordant": {f"{name_a} only": a_only, f"{name_b} only": b_only},
                   "mcnemar_p": mcnemar_exact(a_only, b_only), "identical_outputs": identical,
                   "identical_share": round(identical / len(items), 4)})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
