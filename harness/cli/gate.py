"""`moebench gate`: its options and its exit codes; the rules are moebench.results.gate."""

from __future__ import annotations

from pathlib import Path

import typer

from moebench.results.gate import (EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS, check_output_path, evaluate, junit_xml,
                                   markdown_table, outcome, rich_table, verified_summary, write_output)
from moebench.results.policy import DEFAULTS, load_policy, with_overrides

_HELP_DEFAULT = "policy default: {}"
def gate_command(
    run_dir: Path = typer.Argument(..., help="A results directory (or its summary.json); its raw samples and trials must be there."),
    policy: Path | None = typer.Option(None, "--policy", help="Gate policy TOML (default: ./gate.toml if present, else the built-in defaults; the output names the one applied)."),
    config: str | None = typer.Option(None, "--config", help="Config whose speedup is gated (default: 'all', else the last stacked config)."),
    metric: str | None = typer.Option(None, "--metric", help=f"Speedup gated: output (whole-run output tok/s) or decode (decode steps only) ({_HELP_DEFAULT.format(DEFAULTS.metric)})."),
    min_speedup: float | None = typer.Option(None, "--min-speedup", help=f"Required lower 95% bound of the speedup ({_HELP_DEFAULT.format(DEFAULTS.min_speedup)})."),
    min_identical: float | None = typer.Option(None, "--min-identical", help=f"Required share of outputs identical to the baseline's ({_HELP_DEFAULT.format(DEFAULTS.min_identical)})."),
    baseline: Path | None = typer.Option(None, "--baseline", help="Committed summary.json whose speedup must not regress."),
    max_slowdown: float | None = typer.Option(None, "--max-slowdown", help=f"Allowed fall of the speedup below the committed one ({_HELP_DEFAULT.format(DEFAULTS.max_slowdown)})."),
    margin: float | None = typer.Option(None, "--margin", help=f"Accuracy points a config may lose: the one accuracy knob ({_HELP_DEFAULT.format(DEFAULTS.margin)})."),
    on_inconclusive: str | None = typer.Option(None, "--on-inconclusive", help=f"A rule the run is too small to judge: fail (exit 3), warn or pass (exit 0, said so) ({_HELP_DEFAULT.format(DEFAULTS.on_inconclusive)})."),
    max_ttft_rise: float | None = typer.Option(None, "--max-ttft-rise", help="With offered loads (moebench run --request-rate): how much the gated config's P99 TTFT may exceed the baseline's at every load, as a fraction (0.1: 10%; its 95% CI upper end counts). Default: no latency rule."),
    junit: Path | None = typer.Option(None, "--junit", help="Also write the rules as JUnit XML here."),
    markdown: Path | None = typer.Option(None, "--markdown", help="Also write the rule table as Markdown here."),
) -> None:
    """Check a run against the gate policy: exit 0 if every rule holds, 1 if one fails (a shown regression), 2 on unusable input, 3 if a rule is inconclusive (unless --on-inconclusive warn|pass)."""
    from rich.console import Console

    for path, flag in ((junit, "--junit"), (markdown, "--markdown")):
        if path is not None:
            check_output_path(path, flag)
    pol = with_overrides(load_policy(policy), config=config, metric=metric, min_speedup=min_speedup,
                         min_identical=min_identical,
                         max_slowdown=max_slowdown, baseline=str(baseline) if baseline else None,
                         margin=margin, on_inconclusive=on_inconclusive, max_ttft_rise=max_ttft_rise)
    from moebench.results.summary import read_summary

    summary, checked = verified_summary(run_dir)
    committed = read_summary(Path(pol.baseline)) if pol.baseline else None
    rules = evaluate(summary, pol, committed, committed_source=str(pol.baseline))
    code, last_line = outcome(rules, pol)
    title = f"moebench gate: {summary.get('run_id')} (policy: {pol.source})"
    if junit:
        write_output(junit, junit_xml(rules, title, pol.on_inconclusive), "--junit")
    if markdown:
        write_output(markdown, markdown_table(rules, title, pol).encode("utf-8"), "--markdown")
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)  # CI logs: keep each rule on one line
    console.print(f"policy: {pol.source}; {checked}")
    console.print(rich_table(rules, title))
    for r in rules:
        if r.inconclusive and r.note:
            console.print(f"{r.name}: {r.note}", markup=False, highlight=False)
        if r.warning:
            console.print(f"warning: {r.name}: {r.warning}", markup=False, highlight=False)
    colour = {EXIT_PASS: "green", EXIT_FAIL: "bold red", EXIT_INCONCLUSIVE: "yellow"}[code]
    console.print(f"[{colour}]{last_line}[/{colour}]", highlight=False)
    raise typer.Exit(code)
