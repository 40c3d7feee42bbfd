"""gate_command rules, exit codes, JUnit and Markdown output on fixture summaries."""

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fixtures.make_run import make_run
from moebench.errors import MoebenchError
from moebench.cli.gate import gate_command
from moebench.results.summary import build_summary
from repo_paths import REPO


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("gate")(gate_command)
    app.command("noop")(lambda: None)
    return app


def gate(*args) -> tuple[int, object]:
    """Exit code as the moebench CLI gives it: a MoebenchError is exit 2."""
    result = CliRunner().invoke(_app(), ["gate", *map(str, args)])
    if isinstance(result.exception, MoebenchError):
        return 2, result
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result


@pytest.fixture(autouse=True)
def _no_repo_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # keep ./gate.toml of the repository out of these tests


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """Results directories (raw files plus the summary.json a run writes), by case name."""
    root = tmp_path_factory.mktemp("gate")
    cases = {
        "good": dict(),
        "slow": dict(speed={"kernel": 110.0, "all": 115.0}),
        "drop": dict(flips={"kernel": [1, 2, 4, 5, 6, 7, 8, 9]}),
        "diverge": dict(diverge={"kernel": [5, 6]}),
        "inactive": dict(inactive=("kernel",)),
        "regressed": dict(speed={"kernel": 200.0, "all": 240.0}),
    }
    paths = {}
    for name, kw in cases.items():
        run = make_run(root, run_id=name, configs=("baseline", "kernel", "all"),
                       **({"speed": {"kernel": 200.0, "all": 300.0}} | kw))
        (run / "summary.json").write_text(json.dumps(build_summary(run)))
        paths[name] = run
    old = json.loads((paths["good"] / "summary.json").read_text()) | {"schema": "moebench.summary/0"}
    paths["old"] = root / "old.json"
    paths["old"].write_text(json.dumps(old))
    return paths


def test_pass(summaries):
    code, result = gate(summaries["good"])
    assert code == 0, result.output
    assert "gate: PASS" in result.output and "FAIL" not in result.output


def test_speedup_rule(summaries):
    assert gate(summaries["slow"])[0] == 1
    assert gate(summaries["good"], "--metric", "decode", "--min-speedup", 2.9)[0] == 0   # all: 3x
    assert gate(summaries["good"], "--metric", "decode", "--min-speedup", 3.5)[0] == 1
    assert gate(summaries["good"], "--metric", "decode", "--config", "kernel", "--min-speedup", 2.5)[0] == 1


def test_the_policy_names_the_metric_it_gates(summaries, tmp_path):
    """Whole-run output tok/s (the default) counts the prefill time that decode tok/s leaves out:
    "all" is 3.0x in decode but ~2.9x over the whole run of the fixture."""
    code, result = gate(summaries["good"], "--min-speedup", 2.95)
    assert code == 1 and "output tok/s, whole run" in result.output
    assert gate(summaries["good"], "--min-speedup", 2.95, "--metric", "decode")[0] == 0
    policy = tmp_path / "p.toml"
    policy.write_text('[gate]\nmetric = "decode"\nmin_speedup = 2.95\n')
    code, result = gate(summaries["good"], "--policy", policy)
    assert code == 0 and "decode tok/s" in result.output
    assert gate(summaries["good"], "--metric", "prefill")[0] == 2


def test_accuracy_rules(summaries, tmp_path):
    code, result = gate(summaries["drop"], "--junit", tmp_path / "j.xml")
    assert code == 1
    failed = {c.get("name") for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
              if c.find("failure") is not None}
    # 8 of 40 flipped: 20 points lost (a regression); the identity rule fails too (8 differ).
    assert failed == {"identical outputs kernel", "accuracy kernel: verdict (margin 1)"}
    assert gate(summaries["drop"], "--min-identical", 0)[0] == 1  # the verdict still


def test_identity_rule_and_approximate_policy(summaries, tmp_path):
    assert gate(summaries["diverge"])[0] == 1
    # outputs differ on 2 of 40 items, no answer changed: 40 items cannot show a 1-point margin
    assert gate(summaries["diverge"], "--min-identical", 0.95)[0] == 3
    assert gate(summaries["diverge"], "--min-identical", 0.95, "--margin", 10)[0] == 0
    policy = tmp_path / "p.toml"
    policy.write_text('[gate]\napproximate = ["kernel"]\nmargin = 10\n')
    code, result = gate(summaries["diverge"], "--policy", policy)
    assert code == 0, result.output
    assert "identical outputs kernel" not in result.output


def test_activation_rule(summaries):
    code, result = gate(summaries["inactive"])
    assert code == 1
    assert "activation kernel" in result.output


def test_policy_file_and_flag_override(summaries, tmp_path):
    policy = tmp_path / "gate.toml"
    policy.write_text("[gate]\nmin_speedup = 5.0\n")
    assert gate(summaries["good"], "--policy", policy)[0] == 1
    assert gate(summaries["good"], "--policy", policy, "--min-speedup", 1.5)[0] == 0
    code, result = gate(summaries["good"])
    assert code == 1 and "policy: gate.toml" in result.output  # ./gate.toml is the default, and said so
    policy.write_text("[gate]\nmin_sped = 5.0\n")
    code, result = gate(summaries["good"], "--policy", policy)
    assert code == 2 and "min_sped" in str(result.exception)


def test_committed_baseline(summaries):
    assert gate(summaries["good"], "--baseline", summaries["good"] / "summary.json")[0] == 0
    code, result = gate(summaries["regressed"], "--baseline", summaries["good"] / "summary.json", "--min-speedup", 1)
    assert code == 1  # 2.4x against a committed 3.0x: beyond 10%
    assert "speedup all (output tok/s, whole run) vs committed baseline" in result.output
    assert gate(summaries["regressed"], "--baseline", summaries["good"] / "summary.json", "--min-speedup", 1,
                "--max-slowdown", 0.25)[0] == 0


def test_unusable_input_is_exit_2(summaries, tmp_path):
    code, result = gate(summaries["good"], "--baseline", summaries["old"])
    assert code == 2 and "moebench.summary/1" in str(result.exception)
    code, result = gate(summaries["old"])  # a lone summary file: nothing to check it against
    assert code == 2 and "samples.jsonl" in str(result.exception)
    assert gate(tmp_path / "nope")[0] == 2
    assert gate(summaries["good"], "--config", "nope")[0] == 2
    assert gate(summaries["good"], "--policy", tmp_path / "missing.toml")[0] == 2


def test_junit_and_markdown(summaries, tmp_path):
    code, _ = gate(summaries["diverge"], "--junit", tmp_path / "g.xml", "--markdown", tmp_path / "g.md")
    assert code == 1
    root = ET.parse(tmp_path / "g.xml").getroot()
    cases = list(root.iter("testcase"))
    suite = root.find("testsuite")
    assert int(suite.get("tests")) == len(cases) >= 8
    # the identity rule fails; the verdict is inconclusive (40 items), which fails by default
    assert int(suite.get("failures")) == sum(c.find("failure") is not None for c in cases) == 2
    md = (tmp_path / "g.md").read_text()
    assert "| rule | measured | threshold | verdict |" in md
    assert md.count("| FAIL |") == 1 and ": FAIL" in md
    assert len([line for line in md.splitlines() if line.startswith("| ")]) == len(cases) + 1


def test_help_shows_the_defaults_the_gate_applies():
    from moebench.results.policy import Policy

    out = CliRunner().invoke(_app(), ["gate", "--help"], terminal_width=200).output
    defaults = Policy()
    for value in (defaults.min_speedup, defaults.margin, defaults.min_identical,
                  defaults.max_slowdown, defaults.metric, defaults.on_inconclusive):
        assert f"policy default: {value}" in out


def test_the_repository_policies_restate_no_default(tmp_path):
    """gate.toml at the root is an example whose commented values are the defaults; .ci/gate.toml
    names only what CI changes, and wires in the committed baseline (the regression rule runs)."""
    import re
    import tomllib

    from moebench.results.policy import Policy, load_policy

    root = REPO
    assert load_policy(root / "gate.toml") == Policy()
    for key, value in re.findall(r"^# (\w+) = (.+?)\s+#", (root / "gate.toml").read_text(), re.M):
        v = tomllib.loads(f"v = {value}")["v"]
        assert getattr(Policy(), key) == (tuple(v) if key == "approximate" else
                                          v if isinstance(v, bool) else v or None), key
    ci_table = tomllib.loads((root / ".ci" / "gate.toml").read_text())["gate"]
    assert all(ci_table[k] != getattr(Policy(), k) for k in ci_table if k != "baseline"), ci_table
    ci = load_policy(root / ".ci" / "gate.toml")
    assert ci.baseline and Path(ci.baseline).resolve() == root / "results" / "baselines" / "bundled-host-tier.json"


def test_a_summary_without_its_raw_files_is_refused(summaries, tmp_path):
    import shutil

    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(summaries["good"] / "summary.json", lone / "summary.json")
    code, result = gate(lone)
    assert code == 2 and "lacks manifest.json, samples.jsonl, trials.jsonl" in str(result.exception)
    partial = tmp_path / "partial"
    shutil.copytree(summaries["good"], partial)
    (partial / "trials.jsonl").unlink()
    code, result = gate(partial)
    assert code == 2 and "trials.jsonl" in str(result.exception)


def test_a_summary_that_disagrees_with_its_samples_is_refused(summaries, tmp_path):
    import shutil

    forged = tmp_path / "forged"
    shutil.copytree(summaries["slow"], forged)
    summary = json.loads((forged / "summary.json").read_text())
    for c in summary["configs"]:
        for key in ("speedup", "output_speedup"):
            if c.get("vs_baseline"):
                c["vs_baseline"][key] = {"median": 3.0, "ci95": [2.9, 3.1]}
    (forged / "summary.json").write_text(json.dumps(summary))
    code, result = gate(forged)
    assert code == 2 and "disagrees with the raw samples and trials" in str(result.exception)
    # the raw files are the truth: without the forged summary the gate judges them (and fails)
    (forged / "summary.json").unlink()
    assert gate(forged)[0] == 1


def test_unwritable_outputs_exit_2_before_any_work(summaries, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for flag in ("--junit", "--markdown"):
        code, result = gate(summaries["good"], flag, blocker / "out.xml")
        assert code == 2 and flag in str(result.exception), result.output
        code, result = gate(summaries["good"], flag, tmp_path)
        assert code == 2 and "is a directory" in str(result.exception)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root may write anywhere
            code, result = gate(summaries["good"], "--junit", locked / "j.xml")
            assert code == 2 and "not writable" in str(result.exception)
    finally:
        locked.chmod(0o700)


def test_not_exercised_is_said_not_hidden(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"))
    rows = [json.loads(line) for line in (run / "trials.jsonl").read_text().splitlines()]
    for r in rows:
        r["not_exercised"] = ["scheduler=continuous not exercised: 4 requests fit one batch of 8"] \
            if r["config"] == "kernel" else []
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, result = gate(run, "--metric", "decode", "--min-speedup", 1.5)
    assert code == 0
    assert "not exercised" in result.output
    summary = build_summary(run)
    assert summary["configs"][1]["activation"]["status"] == "not exercised"
