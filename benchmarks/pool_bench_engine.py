"""The rounds of several `moebench bench-engine` runs pooled per cell (threads, batch).

One run's median of 5 rounds moves by 5-10 points of the roofline from run to run on a VM whose
bandwidth drifts by a third from minute to minute (docs/cpu-decode.md). Runs of the same code on
the same checkpoint and settings can be pooled: every round is already paired with its own probes
and with the other engine's run beside it, so the pool is a larger sample of the same quantities.
Per cell it prints each run's median, the pooled median and the geometric mean with its 95% Student t
interval (as bench-engine gives one run's).

    python benchmarks/pool_bench_engine.py RUN.json [RUN.json ...]

Runs whose model, prompt length, new tokens or other engine differ are refused (exit 2). Runs of
different commits (`git_commit`, recorded since 2026-12-02) are pooled with a warning: only the reader
knows whether the commits between them changed the code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moebench.measuring.bench_engine import interval_text, round_interval

SAME = ("vs", "params", "prompt_len", "new_tokens", "kernel", "scheduler")


def load_runs(paths: list[Path]) -> list[dict]:
    runs = []
    for path in paths:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"{path}: not a readable bench-engine manifest ({e})")
        if "rows" not in runs[-1]:
            raise SystemExit(f"{path}: no rows (not a bench-engine manifest)")
    for key in SAME:
        values = {json.dumps(run.get(key)) for run in runs}
        if len(values) > 1:
            raise SystemExit(f"the runs differ in {key} ({', '.join(sorted(values))}): their rounds cannot be pooled")
    return runs


def pool(runs: list[dict]) -> list[dict]:
    """Per (threads, batch): every round's ratio and both engines' paired roofline fractions."""
    cells: dict[tuple[int, int], dict] = {}
    for run in runs:
        for row in run["rows"]:
            cell = cells.setdefault((row["threads"], row["batch"]), {"ratios": [], "fractions": {}, "run_medians": []})
            cell["ratios"] += row["ratio_rounds"]
            for name, engine in row["engines"].items():
                cell["fractions"].setdefault(name, []).extend(engine["roofline_fraction_rounds"])
            cell["run_medians"].append({name: engine["roofline_fraction"] for name, engine in row["engines"].items()})
    out = []
    for (threads, batch), cell in sorted(cells.items()):
        out.append({"threads": threads, "batch": batch, "runs": len(cell["run_medians"]), "rounds": len(cell["ratios"]),
                    "ratio_median": statistics.median(cell["ratios"]), "ratio_interval": round_interval(cell["ratios"]),
                    "engines": {name: {"roofline_fraction": statistics.median(values),
                                       "roofline_fraction_interval": round_interval(values),
                                       "run_medians": [m[name] for m in cell["run_medians"]]}
                                for name, values in cell["fractions"].items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench-engine --out manifests")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs)
        cells = pool(runs)
    except SystemExit as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = list(cells[0]["engines"]) if cells else []
    table = Table(title=f"{len(args.runs)} bench-engine runs pooled (paired % of the roofline; 95% t intervals)")
    for col in ("threads", "batch", "rounds", "ratio, median", "ratio, geomean [95%]"):
        table.add_column(col, justify="right")
    for name in names:
        table.add_column(f"{name} % roof, each run", justify="right")
        table.add_column(f"{name} % roof, pooled median", justify="right")
        table.add_column(f"{name} % roof, geomean [95%]", justify="right")
    for c in cells:
        row = [str(c["threads"]), str(c["batch"]), str(c["rounds"]), f"{c['ratio_median']:.2f}x",
               interval_text(c["ratio_interval"], "x")]
        for name in names:
            e = c["engines"][name]
            row += [", ".join(f"{m:.0%}" for m in e["run_medians"]), f"{e['roofline_fraction']:.0%}",
                    interval_text(e["roofline_fraction_interval"], "%")]
        table.add_row(*row)
    console = Console()
    console.print(table)
    commits = [run.get("git_commit") for run in runs]
    console.print("commits: " + ", ".join(c or "not recorded" for c in commits))
    if len(set(commits)) > 1 or None in commits:
        console.print("warning: these runs are not all of one recorded commit; pool only runs of the same code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
