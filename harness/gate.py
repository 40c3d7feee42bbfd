"""`moebench gate`: the report's verdict as a CI check. Exit 0 if every rule holds, 1 if any
fails; unusable input raises MoebenchError, which the CLI turns into exit 2.

Rules (thresholds from the policy, see gate.toml):
  speedup    the gated config's 95% CI lower bound >= min_speedup
  accuracy   every config: McNemar exact p >= mcnemar_alpha, drop <= max_accuracy_drop points
  identical  every config not marked approximate: identical outputs >= min_identical
  activation every config: each switched-on optimization left evidence that it ran
  regression with a committed summary: the gated config's speedup CI upper bound
             >= committed median x (1 - max_slowdown)
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from moebench.errors import MoebenchError
from moebench.fileio import atomic_write_bytes, atomic_write_text
from moebench.policy import Policy, load_policy, with_overrides
from moebench.summary import config_entry, format_p, load_summary, read_summary

# Preferred gated configs when none is named: the full stack, else the longest partial one.
STACK_PREFERENCE = ("all", "kernel+scheduler", "kernel")


@dataclass(frozen=True)
class Rule:
    name: str
    measured: str
    threshold: str
    passed: bool


def gated_config(summary: dict, requested: str | None) -> str:
    names = [c["name"] for c in summary["configs"]]
    if requested:
        if requested not in names:
            raise MoebenchError(f"run {summary.get('run_id')}: no config {requested!r} (has {names})")
        return requested
    for name in STACK_PREFERENCE:
        if name in names:
            return name
    others = [n for n in names if n != summary["baseline"]]
    if not others:
        raise MoebenchError(f"run {summary.get('run_id')}: only the baseline ran; nothing to gate")
    return others[-1]


def _speedup_rule(summary: dict, name: str, policy: Policy) -> Rule:
    sp = config_entry(summary, name).get("vs_baseline", {}).get("speedup") or {}
    ci = sp.get("ci95")
    measured = "n/a (no interval)" if not ci else f"{sp['median']:.3f}x [{ci[0]:.3f}, {ci[1]:.3f}]"
    return Rule(f"speedup {name}: 95% CI lower bound", measured, f">= {policy.min_speedup:g}x",
                bool(ci) and ci[0] >= policy.min_speedup)


def _accuracy_rules(c: dict, policy: Policy) -> list[Rule]:
    vb = c["vs_baseline"]
    p, delta = vb.get("mcnemar_p"), vb.get("accuracy_delta")
    d = vb.get("discordant") or {}
    drop = None if delta is None else 0.0 - delta  # 0.0 - x: no '-0.00'
    return [
        Rule(f"accuracy {c['name']}: McNemar exact p",
             f"{format_p(p)} ({d.get('baseline_only', '?')} vs {d.get('config_only', '?')} discordant)",
             f">= {policy.mcnemar_alpha:g}", p is not None and p >= policy.mcnemar_alpha),
        Rule(f"accuracy {c['name']}: drop vs baseline",
             "n/a" if drop is None else f"{drop:+.2f} points",
             f"<= {policy.max_accuracy_drop:g} points",
             drop is not None and drop <= policy.max_accuracy_drop + 1e-9),
    ]


def _identity_rule(c: dict, policy: Policy) -> Rule:
    share = c["vs_baseline"].get("identical_outputs")
    return Rule(f"identical outputs {c['name']}",
                "n/a" if share is None else f"{share:.2%} ({c['vs_baseline'].get('differing_outputs', '?')} differ)",
                f">= {policy.min_identical:.2%}", share is not None and share >= policy.min_identical)


def _activation_rule(c: dict) -> Rule:
    a = c["activation"]
    ok = a.get("ok")
    measured = {True: "evidence present", False: "; ".join(a.get("errors") or []) or "no evidence",
                None: "not recorded"}[ok]
    return Rule(f"activation {c['name']}", measured, "every switched-on optimization ran", ok is True)


def _regression_rule(summary: dict, committed: dict, name: str, policy: Policy, source: str) -> Rule:
    try:
        old = config_entry(committed, name)["vs_baseline"]["speedup"]
    except (MoebenchError, KeyError, TypeError):
        raise MoebenchError(f"{source}: has no speedup for config {name!r} to compare with") from None
    if old.get("median") is None:
        raise MoebenchError(f"{source}: speedup of {name!r} is null")
    now = config_entry(summary, name)["vs_baseline"]["speedup"]
    floor = old["median"] * (1 - policy.max_slowdown)
    ci = now.get("ci95")
    return Rule(f"speedup {name} vs committed baseline",
                "n/a (no interval)" if not ci else f"{now['median']:.3f}x, CI upper {ci[1]:.3f}",
                f"CI upper >= {floor:.3f}x ({old['median']:.3f}x - {policy.max_slowdown:.0%})",
                bool(ci) and ci[1] >= floor)


def evaluate(summary: dict, policy: Policy, committed: dict | None = None,
             committed_source: str = "baseline summary") -> list[Rule]:
    """Every rule's outcome for one run's summary."""
    name = gated_config(summary, policy.config)
    rules = [_speedup_rule(summary, name, policy)]
    if committed is not None:
        rules.append(_regression_rule(summary, committed, name, policy, committed_source))
    for c in summary["configs"]:
        if c.get("vs_baseline"):
            rules += _accuracy_rules(c, policy)
            if c["name"] not in policy.approximate:
                rules.append(_identity_rule(c, policy))
    rules += [_activation_rule(c) for c in summary["configs"]]
    return rules


# ---------------------------------------------------------------- output

def _verdict(rule: Rule) -> str:
    return "pass" if rule.passed else "FAIL"


def rich_table(rules: list[Rule], title: str) -> Table:
    table = Table(title=title)
    for col in ("rule", "measured", "threshold", "verdict"):
        table.add_column(col)
    for r in rules:
        table.add_row(r.name, r.measured, r.threshold,
                      "[green]pass[/green]" if r.passed else "[bold red]FAIL[/bold red]")
    return table


def junit_xml(rules: list[Rule], suite: str) -> bytes:
    failures = sum(not r.passed for r in rules)
    root = ET.Element("testsuites", name="moebench gate", tests=str(len(rules)), failures=str(failures))
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(rules)), failures=str(failures),
                       errors="0", skipped="0")
    for r in rules:
        case = ET.SubElement(ts, "testcase", classname="moebench.gate", name=r.name)
        if not r.passed:  # the JUnit schema puts <failure> before <system-out>
            ET.SubElement(case, "failure", message=f"measured {r.measured}, required {r.threshold}",
                          type="GateFailure").text = f"{r.name}: measured {r.measured}, required {r.threshold}"
        ET.SubElement(case, "system-out").text = f"measured {r.measured}; threshold {r.threshold}"
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def markdown_table(rules: list[Rule], title: str) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")
    passed = all(r.passed for r in rules)
    lines = [f"### {cell(title)}: {'PASS' if passed else 'FAIL'}", "",
             "| rule | measured | threshold | verdict |", "|---|---|---|---|"]
    lines += [f"| {cell(r.name)} | {cell(r.measured)} | {cell(r.threshold)} | {_verdict(r)} |" for r in rules]
    return "\n".join(lines) + "\n"


def gate_command(
    run_dir: Path = typer.Argument(..., help="A results directory (or its summary.json)."),
    policy: Path | None = typer.Option(None, "--policy", help="Gate policy TOML (default: ./gate.toml if present)."),
    config: str | None = typer.Option(None, "--config", help="Config whose speedup is gated (default: 'all', else the last stacked config)."),
    min_speedup: float | None = typer.Option(None, "--min-speedup", help="Required lower 95% bound of the speedup (policy default 1.2)."),
    max_accuracy_drop: float | None = typer.Option(None, "--max-accuracy-drop", help="Accuracy points any config may lose (policy default 0.5)."),
    min_identical: float | None = typer.Option(None, "--min-identical", help="Required share of outputs identical to the baseline's (policy default 0.99)."),
    baseline: Path | None = typer.Option(None, "--baseline", help="Committed summary.json whose speedup must not regress."),
    max_slowdown: float | None = typer.Option(None, "--max-slowdown", help="Allowed fall of the speedup below the committed one (policy default 0.10)."),
    junit: Path | None = typer.Option(None, "--junit", help="Also write the rules as JUnit XML here."),
    markdown: Path | None = typer.Option(None, "--markdown", help="Also write the rule table as Markdown here."),
) -> None:
    """Check a run against the gate policy: exit 0 if every rule holds, 1 if any fails."""
    pol = with_overrides(load_policy(policy), config=config, min_speedup=min_speedup,
                         max_accuracy_drop=max_accuracy_drop, min_identical=min_identical,
                         max_slowdown=max_slowdown, baseline=str(baseline) if baseline else None)
    summary = load_summary(run_dir)
    committed = read_summary(Path(pol.baseline)) if pol.baseline else None
    rules = evaluate(summary, pol, committed, committed_source=str(pol.baseline))
    passed = all(r.passed for r in rules)
    title = f"moebench gate: {summary.get('run_id')}"
    if junit:
        atomic_write_bytes(junit, junit_xml(rules, title))
    if markdown:
        atomic_write_text(markdown, markdown_table(rules, title))
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)  # CI logs: keep each rule on one line
    console.print(rich_table(rules, title))
    n_fail = sum(not r.passed for r in rules)
    console.print("[green]gate: PASS[/green]" if passed else f"[bold red]gate: FAIL[/bold red] ({n_fail} of {len(rules)} rules)")
    raise typer.Exit(0 if passed else 1)
