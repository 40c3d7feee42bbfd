"""`moebench plan`: its options, checked; the arithmetic is moebench.results.plan."""

from __future__ import annotations


import typer

from moebench.errors import MoebenchError
from moebench.results.plan import plan_text
from moebench.results.policy import DEFAULTS

def plan_command(
    items: int = typer.Option(..., "--items", help="Items the run will answer (e.g. 1319 for GSM8K's test split)."),
    baseline_accuracy: float = typer.Option(..., "--baseline-accuracy", help="Expected accuracy of the baseline, a fraction (0.9 for 90%)."),
    trials: int = typer.Option(1, "--trials", help="Trials per item (seeds under sampling; greedy trials repeat and count as one)."),
    margin: float = typer.Option(DEFAULTS.margin, "--margin", help=f"Accuracy points a config may lose (default {DEFAULTS.margin:g}, as in the gate policy)."),
    discordance: float | None = typer.Option(None, "--discordance", help="Share of pairs whose correctness differs per trial, e.g. from a pilot run (default: 2p(1-p), independent samples)."),
) -> None:
    """Print the drop a run of this size would catch and the items it needs to pass, before spending GPU hours."""
    if items < 1:
        raise MoebenchError(f"--items {items}: give at least 1 item")
    if not 0 < baseline_accuracy < 1:
        hint = f" (a fraction: {baseline_accuracy / 100:g}?)" if 1 < baseline_accuracy < 100 else ""
        raise MoebenchError(f"--baseline-accuracy {baseline_accuracy:g}: give a fraction between 0 and 1{hint}")
    if trials < 1:
        raise MoebenchError(f"--trials {trials}: give at least 1 trial")
    if not 0 < margin < 100:
        raise MoebenchError(f"--margin {margin:g}: give accuracy points between 0 and 100")
    if discordance is not None and not 0 <= discordance <= 1:
        raise MoebenchError(f"--discordance {discordance:g}: give a share between 0 and 1")
    print(plan_text(items, baseline_accuracy, trials, margin, discordance))
