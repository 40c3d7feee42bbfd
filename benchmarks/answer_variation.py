"""How much sampling and each config move a run's answers, read from its samples.jsonl.

The summary judges each config against the baseline; this prints what the judging is about, for a
sampled run (issue 50's targets): the baseline's accuracy per trial; the share of items whose
correctness varies across its trials; the share of outputs that differ between two baseline trials
(different seeds), per pair; and for every other config, paired with the baseline on the same trial
and item (same seed), the share of outputs and of extracted answers that differ, with the counts of
answers that went right -> wrong and wrong -> right.

    python benchmarks/answer_variation.py results/reference-protocol [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(run_dir: Path) -> dict[str, dict[tuple[int, str], dict]]:
    """config -> (trial, item id) -> sample row."""
    rows: dict[str, dict[tuple[int, str], dict]] = defaultdict(dict)
    with (run_dir / "samples.jsonl").open() as f:
        for line in f:
            r = json.loads(line)
            rows[r["config"]][(int(r["trial"]), r["item_id"])] = r
    return rows


def baseline_figures(base: dict[tuple[int, str], dict]) -> dict:
    trials = sorted({t for t, _ in base})
    items = sorted({i for _, i in base})
    per_trial = {t: sum(base[(t, i)]["correct"] for i in items) / len(items) for t in trials}
    varying = sum(len({base[(t, i)]["correct"] for t in trials}) > 1 for i in items)
    pairs = {f"{a}-{b}": sum(base[(a, i)]["output"] != base[(b, i)]["output"] for i in items) / len(items)
             for a, b in itertools.combinations(trials, 2)}
    return {"trials": len(trials), "items": len(items),
            "accuracy_per_trial": per_trial,
            "accuracy": sum(per_trial.values()) / len(trials),
            "varying_items": varying, "varying_share": varying / len(items),
            "outputs_differing_between_trials": pairs,
            "outputs_differing_min": min(pairs.values()) if pairs else None,
            "outputs_differing_mean": sum(pairs.values()) / len(pairs) if pairs else None}


def config_figures(base: dict, other: dict) -> dict:
    keys = sorted(set(base) & set(other))
    out_diff = sum(base[k]["output"] != other[k]["output"] for k in keys)
    ans_diff = sum(base[k]["answer"] != other[k]["answer"] for k in keys)
    lost = sum(base[k]["correct"] and not other[k]["correct"] for k in keys)
    gained = sum(other[k]["correct"] and not base[k]["correct"] for k in keys)
    return {"pairs": len(keys), "outputs_differing": out_diff, "outputs_differing_share": out_diff / len(keys),
            "answers_differing": ans_diff, "answers_differing_share": ans_diff / len(keys),
            "right_to_wrong": lost, "wrong_to_right": gained,
            "accuracy": sum(other[k]["correct"] for k in keys) / len(keys)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--baseline", default="baseline")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not (args.run_dir / "samples.jsonl").is_file():
        print(f"{args.run_dir}: no samples.jsonl", file=sys.stderr)
        return 2
    rows = load(args.run_dir)
    if args.baseline not in rows:
        print(f"{args.run_dir}: no config named {args.baseline!r} (has {', '.join(rows)})", file=sys.stderr)
        return 2
    base = rows[args.baseline]
    fig = {"baseline": baseline_figures(base),
           "configs": {name: config_figures(base, r) for name, r in rows.items() if name != args.baseline}}
    b = fig["baseline"]
    print(f"baseline: {b['items']} items x {b['trials']} trials, accuracy {100 * b['accuracy']:.1f}% "
          f"(per trial {', '.join(f'{100 * v:.1f}' for v in b['accuracy_per_trial'].values())})")
    print(f"  items whose correctness varies across trials: {b['varying_items']} ({100 * b['varying_share']:.1f}%)")
    if b["outputs_differing_mean"] is not None:
        print(f"  outputs differing between two trials (seeds): mean {100 * b['outputs_differing_mean']:.1f}%, "
              f"min {100 * b['outputs_differing_min']:.1f}% over {len(b['outputs_differing_between_trials'])} pairs")
    print(f"{'config':<24}{'outputs differ':>16}{'answers differ':>16}{'right->wrong':>14}{'wrong->right':>14}{'accuracy':>10}")
    for name, c in fig["configs"].items():
        print(f"{name:<24}{100 * c['outputs_differing_share']:>15.2f}%{100 * c['answers_differing_share']:>15.2f}%"
              f"{c['right_to_wrong']:>14}{c['wrong_to_right']:>14}{100 * c['accuracy']:>9.1f}%")
    if args.json:
        args.json.write_text(json.dumps(fig, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
