"""`moebench gate`: the report's verdict as a CI check. Each rule passes, fails (the run shows
the problem) or is inconclusive (the run is too small to tell). Exit 1 if any rule fails; else 3 if
any is inconclusive and the policy's on_inconclusive is "fail" (the default); else 0 ("warn" and
"pass" let inconclusive rules through, said so in the output). Unusable input raises
MoebenchError, which the CLI turns into exit 2 (one line). That includes a results directory whose
summary.json disagrees with its raw samples and trials, or lacks them, and an output path
(--junit, --markdown) that cannot be written: exit 1 means a shown problem and nothing else.

Rules (thresholds from the policy, moebench.results.policy; the policy's `metric` picks the speedup,
whole-run output tok/s or decode tok/s):
  speedup    the gated config's 95% CI: lower bound >= min_speedup passes, upper bound below it
             fails, an interval across it (or none: one trial) is inconclusive
  accuracy   every config: the decision table of moebench.results.verdict at `margin`: identical
             and non-inferior pass (a drop shown within the margin is a warning), regression
             fails, inconclusive is inconclusive and says what run would decide it
  identical  every exact config: identical outputs >= min_identical
  activation every config: each switched-on optimization left evidence that it ran (a switch the
             workload could not exercise passes, and says "not exercised")
  regression with a committed summary: the gated config's speedup CI upper bound
             >= committed median x (1 - max_slowdown); no interval is inconclusive
  latency    with max_ttft_rise set: at every offered load, the gated config's P99 TTFT
             over the baseline's (per-trial paired ratios, 95% CI) passes when the upper end is
             <= 1 + max_ttft_rise, fails when the lower end is above it, else (or with no
             offered loads in the run) is inconclusive
Approximate configs (policy `approximate`, or marked so in the run's manifest) may change
outputs: only the verdict judges their accuracy.
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


from moebench.errors import MoebenchError
from moebench.results.policy import DEFAULTS, Policy

# Preferred gated configs when none is named: the full stack, else the longest partial one.
STACK_PREFERENCE = ("all", "kernel+scheduler", "kernel")


@dataclass(frozen=True)
class Rule:
    name: str
    measured: str
    threshold: str
    passed: bool
    inconclusive: bool = False  # not passed, but not shown to fail either: too little data
    note: str = ""              # what to do about an inconclusive rule
    warning: str = ""           # passed, with something the reader should know (a drop within the margin)

    @property
    def status(self) -> str:
        return "pass" if self.passed else ("inconclusive" if self.inconclusive else "FAIL")


def _spans(ci: list[float], what: str = "x") -> str:
    return f"inconclusive: the interval spans {ci[0]:.2f}-{ci[1]:.2f}{what}; rerun with more --repeats"


NO_INTERVAL = "inconclusive: one trial gives no interval; rerun with --repeats 2 or more (5 or more to judge)"


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


SPEEDUP_KEYS = {"decode": "speedup", "output": "output_speedup"}
METRIC_WORDS = {"decode": "decode tok/s", "output": "output tok/s, whole run"}


def _speedup_of(entry: dict, metric: str) -> dict:
    return (entry.get("vs_baseline") or {}).get(SPEEDUP_KEYS[metric]) or {}


def _ratio_measured(block: dict) -> str:
    """A ratio's median, 95% CI and trials, as a rule's `measured` says them."""
    ci = block.get("ci95")
    if not ci:
        return "n/a (no interval: fewer than 2 trials)"
    return f"{block['median']:.3f}x [{ci[0]:.3f}, {ci[1]:.3f}], {len(block.get('trials') or [])} trials"


def _speedup_rule(summary: dict, name: str, policy: Policy) -> Rule:
    from moebench.results.summary import config_entry

    sp = _speedup_of(config_entry(summary, name), policy.metric)
    ci = sp.get("ci95")
    measured = _ratio_measured(sp)
    passed = bool(ci) and ci[0] >= policy.min_speedup
    # Only an interval wholly below the threshold shows that the speedup falls short of it.
    unsure = not passed and (not ci or ci[1] >= policy.min_speedup)
    return Rule(f"speedup {name} ({METRIC_WORDS[policy.metric]}): 95% CI lower bound", measured,
                f">= {policy.min_speedup:g}x", passed, unsure,
                (_spans(ci) if ci else NO_INTERVAL) if unsure else "")


def approximate(c: dict, policy: Policy) -> bool:
    """May this config change outputs? The policy says so, or the run's manifest did."""
    return c["name"] in policy.approximate or bool(c.get("approximate"))


def _what_would_decide(diff: dict, margin: float) -> str:
    """`moebench plan`'s figure for this run: items for a non-inferior verdict with 80% probability
    if nothing changed, with answers as discordant and as clustered as here."""
    from moebench.results.paired_accuracy import items_for_margin

    trials = max(int(diff.get("trials") or 1), 1)
    psi = diff.get("discordance")
    if psi is None:
        return "rerun with more items (or more trials under sampling)"
    need = items_for_margin(margin / 100, 0.5, trials, discordance=psi, deff=diff.get("design_effect") or 1.0)
    return (f"about {need['diverged']} items x {trials} trial{'s' if trials != 1 else ''} would show "
            f"non-inferiority at a {margin:g}-point margin with 80% probability if nothing changed, answers "
            f"differing as in this run (moebench plan --discordance {psi:.3g})")


def _verdict_rule(c: dict, policy: Policy) -> Rule:
    from moebench.results.verdict import PASSING, judge_accuracy

    vb = c["vs_baseline"]
    v = judge_accuracy(vb, policy.margin, exact=not approximate(c, policy))
    diff = vb.get("accuracy_difference") or {}
    ci = diff.get("ci95")
    measured = "n/a (no paired items)" if not ci else (
        f"{v['verdict']}, {diff['points']:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}]"
        + (f"; a drop >= {v['detectable_drop']:.1f} would be a regression (80%)"
           if v.get("detectable_drop") is not None and v["verdict"] != "regression" else ""))
    unsure = v["verdict"] == "inconclusive"
    note = ""
    if unsure:
        trials = diff.get("trial_check") or {}
        why = (f"trials disagree (trial {trials.get('standout')} stands out)" if trials.get("flagged") else
               f"the interval {ci[0]:+.2f} to {ci[1]:+.2f} points reaches below -{policy.margin:g} and above 0")
        note = f"inconclusive: {why}; {_what_would_decide(diff, policy.margin)}"
    return Rule(f"accuracy {c['name']}: verdict (margin {policy.margin:g})", measured,
                f"CI lower > -{policy.margin:g} pts", v["verdict"] in PASSING, unsure, note,
                v.get("warning") or "")


def _identity_rule(c: dict, policy: Policy) -> Rule:
    share = c["vs_baseline"].get("identical_outputs")
    return Rule(f"identical outputs {c['name']}",
                "n/a" if share is None else f"{share:.2%} ({c['vs_baseline'].get('differing_outputs', '?')} differ)",
                f">= {policy.min_identical:.2%}", share is not None and share >= policy.min_identical)


def _activation_rule(c: dict) -> Rule:
    a = c["activation"]
    ok = a.get("ok")
    if ok is True and a.get("not_exercised"):
        measured = "evidence present; " + "; ".join(a["not_exercised"])
    else:
        measured = {True: "evidence present", False: "; ".join(a.get("errors") or []) or "no evidence",
                    None: "not recorded"}[ok]
    return Rule(f"activation {c['name']}", measured, "each switched-on optimization ran", ok is True)


def _committed_speedup(committed: dict, name: str, metric: str, source: str) -> float:
    """The committed summary's median speedup of `name` in `metric`. A summary written before
    output_speedup existed still has both configs' output tok/s medians: their ratio stands in."""
    from moebench.results.summary import config_entry

    try:
        entry = config_entry(committed, name)
    except (MoebenchError, KeyError, TypeError):
        raise MoebenchError(f"{source}: has no config {name!r} to compare with") from None
    median = _speedup_of(entry, metric).get("median")
    if median is None and metric == "output":
        try:
            mine = entry["output_tokens_per_s"]["median"]
            base = config_entry(committed, committed["baseline"])["output_tokens_per_s"]["median"]
            median = mine / base if mine and base else None
        except (MoebenchError, KeyError, TypeError):
            median = None
    if median is None:
        raise MoebenchError(f"{source}: has no {METRIC_WORDS[metric]} speedup for config {name!r} to compare with")
    return float(median)


def _regression_rule(summary: dict, committed: dict, name: str, policy: Policy, source: str) -> Rule:
    from moebench.results.summary import config_entry

    old = _committed_speedup(committed, name, policy.metric, source)
    now = _speedup_of(config_entry(summary, name), policy.metric)
    floor = old * (1 - policy.max_slowdown)
    ci = now.get("ci95")
    return Rule(f"speedup {name} ({METRIC_WORDS[policy.metric]}) vs committed baseline",
                "n/a (no interval)" if not ci else f"{now['median']:.3f}x, CI upper {ci[1]:.3f}",
                f"CI upper >= {floor:.3f}x ({old:.3f}x - {policy.max_slowdown:.0%})",
                bool(ci) and ci[1] >= floor, not ci, "" if ci else NO_INTERVAL)


def evaluate(summary: dict, policy: Policy, committed: dict | None = None,
             committed_source: str = "baseline summary") -> list[Rule]:
    """Every rule's outcome for one run's summary."""
    name = gated_config(summary, policy.config)
    rules = [_speedup_rule(summary, name, policy)]
    if committed is not None:
        rules.append(_regression_rule(summary, committed, name, policy, committed_source))
    for c in summary["configs"]:
        if c.get("vs_baseline"):
            rules.append(_verdict_rule(c, policy))
            if not approximate(c, policy):
                rules.append(_identity_rule(c, policy))
    rules += [_activation_rule(c) for c in summary["configs"]]
    if policy.max_ttft_rise is not None:
        rules += _latency_rules(summary, name, policy.max_ttft_rise)
    return rules


def _latency_rules(summary: dict, name: str, max_increase: float) -> list[Rule]:
    limit = 1 + max_increase
    threshold = f"<= {limit:.3g}x the baseline's"
    title = f"latency {name}: P99 TTFT ratio, 95% CI upper end"
    serving = summary.get("serving")
    if not serving:
        return [Rule(title, "n/a (a closed-loop run: no offered loads)", threshold, False, True,
                     "inconclusive: run with --request-rate (docs/serving-load.md) for the latency rule to judge")]
    points = serving["configs"].get(name) or {}
    rules = []
    # every load of the run, also one the gated config has no samples at: a missing load is never a pass
    for label in (ld["label"] for ld in serving["loads"]):
        ratio = ((points.get(label) or {}).get("vs_baseline") or {}).get("p99_ttft_ratio") or {}
        ci = ratio.get("ci95")
        passed = bool(ci) and ci[1] <= limit
        unsure = not passed and (not ci or ci[0] <= limit)
        rules.append(Rule(f"{title} @ {label}", _ratio_measured(ratio), threshold, passed, unsure,
                          (_spans(ci) if ci else NO_INTERVAL) if unsure else ""))
    return rules


# ---------------------------------------------------------------- output

EXIT_PASS, EXIT_FAIL, EXIT_INCONCLUSIVE = 0, 1, 3


def outcome(rules: list[Rule], policy: Policy) -> tuple[int, str]:
    """The exit code and the last line: a failed rule is exit 1; an inconclusive one is exit 3
    unless the policy's on_inconclusive lets it pass ("warn" or "pass"), which the line says."""
    failed = sum(r.status == "FAIL" for r in rules)
    unsure = sum(r.inconclusive for r in rules)
    warned = sum(bool(r.warning) for r in rules)
    tail = f"; {warned} warning{'s' if warned != 1 else ''}" if warned else ""
    if failed:
        more = f"; {unsure} more inconclusive" if unsure else ""
        return EXIT_FAIL, f"gate: FAIL ({failed} of {len(rules)} rules{more}{tail})"
    if unsure and policy.on_inconclusive == "fail":
        return EXIT_INCONCLUSIVE, (f"gate: INCONCLUSIVE ({unsure} of {len(rules)} rules could not be judged; "
                                   f"on_inconclusive = fail; exit 3{tail})")
    if unsure:
        return EXIT_PASS, (f"gate: PASS, but {unsure} of {len(rules)} rules inconclusive (too little data to "
                           f"judge them; the policy's on_inconclusive = {policy.on_inconclusive} lets them pass{tail})")
    return EXIT_PASS, f"gate: PASS{tail}"


def _verdict(rule: Rule) -> str:
    return rule.status


def rich_table(rules: list[Rule], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("rule", "measured", "threshold", "verdict"):
        table.add_column(col)
    style = {"pass": "[green]pass[/green]", "FAIL": "[bold red]FAIL[/bold red]",
             "inconclusive": "[yellow]inconclusive[/yellow]"}
    for r in rules:
        table.add_row(r.name, r.measured, r.threshold, style[r.status])
    return table


def junit_xml(rules: list[Rule], suite: str, on_inconclusive: str = "fail") -> bytes:
    """One testcase per rule: a failed rule is a <failure>; an inconclusive one is a
    <failure type="GateInconclusive">, or <skipped> where on_inconclusive lets it pass."""
    inconclusive_fails = on_inconclusive == "fail"
    def failing(r: Rule) -> bool:
        return r.status == "FAIL" or (r.inconclusive and inconclusive_fails)
    failures = sum(failing(r) for r in rules)
    skipped = sum(r.inconclusive and not inconclusive_fails for r in rules)
    root = ET.Element("testsuites", name="moebench gate", tests=str(len(rules)), failures=str(failures))
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(rules)), failures=str(failures),
                       errors="0", skipped=str(skipped))
    for r in rules:
        case = ET.SubElement(ts, "testcase", classname="moebench.gate", name=r.name)
        # the JUnit schema puts <failure> and <skipped> before <system-out>
        if r.inconclusive and not inconclusive_fails:
            ET.SubElement(case, "skipped", message=r.note or "inconclusive")
        elif failing(r):
            kind = "GateInconclusive" if r.inconclusive else "GateFailure"
            text = r.note if r.inconclusive else f"measured {r.measured}, required {r.threshold}"
            ET.SubElement(case, "failure", message=text, type=kind).text = f"{r.name}: {text}"
        ET.SubElement(case, "system-out").text = f"measured {r.measured}; threshold {r.threshold}"
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def markdown_table(rules: list[Rule], title: str, policy: Policy = DEFAULTS) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")
    code, _ = outcome(rules, policy)
    word = {EXIT_PASS: "PASS", EXIT_FAIL: "FAIL", EXIT_INCONCLUSIVE: "INCONCLUSIVE"}[code]
    if code == EXIT_PASS and any(r.inconclusive for r in rules):
        word = "PASS (some rules inconclusive)"
    lines = [f"### {cell(title)}: {word}", "",
             "| rule | measured | threshold | verdict |", "|---|---|---|---|"]
    lines += [f"| {cell(r.name)} | {cell(r.measured)} | {cell(r.threshold)} | {_verdict(r)} |" for r in rules]
    notes = [f"- {cell(r.name)}: {cell(r.note)}" for r in rules if r.inconclusive and r.note]
    notes += [f"- {cell(r.name)}: warning: {cell(r.warning)}" for r in rules if r.warning]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# ---------------------------------------------------------------- trust, but verify

def _close(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def _checked_fields(summary: dict) -> dict:
    """What the gate's rules read from a summary, per config."""
    out = {}
    for c in summary.get("configs") or []:
        vb = c.get("vs_baseline") or {}
        fields = {"activation.ok": (c.get("activation") or {}).get("ok"),
                  "accuracy.correct": (c.get("accuracy") or {}).get("correct"),
                  "accuracy.total": (c.get("accuracy") or {}).get("total"),
                  "identical_outputs": vb.get("identical_outputs"), "mcnemar_p": vb.get("mcnemar_p"),
                  "accuracy_delta": vb.get("accuracy_delta")}
        if "accuracy_difference" in vb:  # absent from summaries written before it existed
            diff = vb["accuracy_difference"] or {}
            fields["accuracy_difference.points"] = diff.get("points")
            for i, v in enumerate(diff.get("ci95") or [None, None]):
                fields[f"accuracy_difference.ci95[{i}]"] = v
        for metric, key in SPEEDUP_KEYS.items():
            sp = vb.get(key) or {}
            fields[f"{key}.median"] = sp.get("median")
            for i, v in enumerate(sp.get("ci95") or [None, None]):
                fields[f"{key}.ci95[{i}]"] = v
        out[c.get("name")] = fields
    return out


def verified_summary(target: Path) -> tuple[dict, str]:
    """The summary to gate, recomputed from the run's raw files (manifest, samples, trials), and
    a note on what was checked. A summary.json beside them must agree with the recomputation on
    every number a rule reads; raw files that are missing, or a summary that disagrees, are a
    MoebenchError (exit 2): a results folder holding only a summary proves nothing."""
    from moebench.results.summary import SCHEMA, build_summary, read_summary

    target = Path(target)
    run_dir = target.parent if target.is_file() else target
    if not run_dir.is_dir():
        raise MoebenchError(f"{target}: no such results directory")
    missing = [f for f in ("manifest.json", "samples.jsonl", "trials.jsonl") if not (run_dir / f).is_file()]
    if missing:
        raise MoebenchError(f"{run_dir}: lacks {', '.join(missing)}; the gate recomputes the summary from the "
                            "raw samples and trials and will not trust a summary.json alone")
    recomputed = build_summary(run_dir)
    written = target if target.is_file() else run_dir / "summary.json"
    if not written.is_file():
        return recomputed, "summary computed from the raw samples and trials (no summary.json)"
    try:
        summary = read_summary(written)
    except MoebenchError:
        return recomputed, f"{written.name} is not {SCHEMA}: summary recomputed from the raw samples and trials"
    mine, theirs = _checked_fields(recomputed), _checked_fields(summary)
    diffs = []
    for name in sorted(set(mine) | set(theirs), key=str):
        a, b = theirs.get(name), mine.get(name)
        if a is None or b is None:
            diffs.append(f"config {name!r} {'only in summary.json' if b is None else 'missing from summary.json'}")
            continue
        diffs += [f"{name} {k}: {a[k]} in summary.json, {b[k]} from the raw files"
                  for k in b if k in a and not _close(a[k], b[k])]
    if diffs:
        raise MoebenchError(f"{written}: disagrees with the raw samples and trials ({'; '.join(diffs[:3])}"
                            f"{f'; {len(diffs) - 3} more' if len(diffs) > 3 else ''}); rebuild it "
                            "(delete it and run moebench report or gate again) or find out who changed it")
    return recomputed, f"{written.name} checked against the raw samples and trials"


def check_output_path(path: Path, flag: str) -> None:
    """Refuse, before any work, an output file that cannot be written (exit 2, one line)."""
    path = Path(path)
    if path.is_dir():
        raise MoebenchError(f"{flag} {path}: is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise MoebenchError(f"{flag} {path}: directory {parent} does not exist (or is not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise MoebenchError(f"{flag} {path}: not writable")


def write_output(path: Path, data: bytes, flag: str) -> None:
    from moebench.fileio import atomic_write_bytes

    try:
        atomic_write_bytes(path, data)
    except OSError as e:
        raise MoebenchError(f"{flag} {path}: cannot write ({e.strerror or e})") from None


