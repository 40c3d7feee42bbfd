"""gate_command rules, exit codes, JUnit and Markdown output on fixture summaries."""

import json
import xml.etree.ElementTree as ET

import pytest
import typer
from typer.testing import CliRunner

from fixtures.make_run import make_run
from moebench.errors import MoebenchError
from moebench.gate import gate_command
from moebench.summary import build_summary


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
        s = build_summary(make_run(root, run_id=name, configs=("baseline", "kernel", "all"),
                                   **({"speed": {"kernel": 200.0, "all": 300.0}} | kw)))
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps(s))
    old = json.loads(paths["good"].read_text()) | {"schema": "moebench.summary/0"}
    paths["old"] = root / "old.json"
    paths["old"].write_text(json.dumps(old))
    return paths


def test_pass(summaries):
    code, result = gate(summaries["good"])
    assert code == 0, result.output
    assert "gate: PASS" in result.output and "FAIL" not in result.output


def test_speedup_rule(summaries):
    assert gate(summaries["slow"])[0] == 1
    assert gate(summaries["good"], "--min-speedup", 2.9)[0] == 0   # all: 3x
    assert gate(summaries["good"], "--min-speedup", 3.5)[0] == 1
    assert gate(summaries["good"], "--config", "kernel", "--min-speedup", 2.5)[0] == 1  # kernel: 2x


def test_accuracy_rules(summaries, tmp_path):
    code, result = gate(summaries["drop"], "--junit", tmp_path / "j.xml")
    assert code == 1
    failed = {c.get("name") for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
              if c.find("failure") is not None}
    # 8 of 40 flipped: p = 2/2^8, 20 points lost; the identity rule fails too (8 differ).
    assert failed == {"accuracy kernel: McNemar exact p", "accuracy kernel: drop vs baseline",
                      "identical outputs kernel"}
    assert gate(summaries["drop"], "--max-accuracy-drop", 25, "--min-identical", 0)[0] == 1  # McNemar still


def test_identity_rule_and_approximate_policy(summaries, tmp_path):
    assert gate(summaries["diverge"])[0] == 1
    assert gate(summaries["diverge"], "--min-identical", 0.95)[0] == 0
    policy = tmp_path / "p.toml"
    policy.write_text('[gate]\napproximate = ["kernel"]\n')
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
    assert gate(summaries["good"])[0] == 1  # ./gate.toml is the default policy
    policy.write_text("[gate]\nmin_sped = 5.0\n")
    code, result = gate(summaries["good"], "--policy", policy)
    assert code == 2 and "min_sped" in str(result.exception)


def test_committed_baseline(summaries):
    assert gate(summaries["good"], "--baseline", summaries["good"])[0] == 0
    code, result = gate(summaries["regressed"], "--baseline", summaries["good"], "--min-speedup", 1)
    assert code == 1  # 2.4x against a committed 3.0x: beyond 10%
    assert "speedup all vs committed baseline" in result.output
    assert gate(summaries["regressed"], "--baseline", summaries["good"], "--min-speedup", 1,
                "--max-slowdown", 0.25)[0] == 0


def test_unusable_input_is_exit_2(summaries, tmp_path):
    code, result = gate(summaries["good"], "--baseline", summaries["old"])
    assert code == 2 and "moebench.summary/1" in str(result.exception)
    code, result = gate(summaries["old"])
    assert code == 2 and "schema" in str(result.exception)
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
    assert int(suite.get("failures")) == sum(c.find("failure") is not None for c in cases) == 1
    md = (tmp_path / "g.md").read_text()
    assert "| rule | measured | threshold | verdict |" in md
    assert md.count("| FAIL |") == 1 and ": FAIL" in md
    assert len([line for line in md.splitlines() if line.startswith("| ")]) == len(cases) + 1
