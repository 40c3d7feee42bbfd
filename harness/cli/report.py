"""`moebench report`: its options; the report itself is moebench.results.report."""

from __future__ import annotations

from pathlib import Path

import typer

from moebench.results.report import write_report

def report_command(
    run_dir: Path = typer.Argument(..., help="A results directory written by `moebench run`."),
    out: Path | None = typer.Option(None, "--out", help="Report directory (default: reports/<run-id>/)."),
    margin: float | None = typer.Option(None, "--margin", help="Non-inferiority margin of the accuracy verdicts, in points (default: the summary's, 1.0 unless built otherwise)."),
) -> None:
    """Write a Markdown and a self-contained HTML report with plots for one run."""
    from rich.console import Console

    out_dir = write_report(run_dir, out, margin)
    n_png = len(list(out_dir.glob("*.png")))
    Console().print(f"wrote {out_dir / 'report.md'}, {out_dir / 'report.html'} and {n_png} plots")
