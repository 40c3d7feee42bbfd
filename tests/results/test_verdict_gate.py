"""The gate's three outcomes on real fixture runs: a shown failure (exit 1), an inconclusive rule
(exit 3 by default; passes, said so, where on_inconclusive is warn or pass), and the accuracy
verdict of approximate configs; and `moebench plan`."""

import json
import xml.etree.ElementTree as ET

import pytest
import typer
from typer.testing import CliRunner

from fixtures.make_run import make_run
from moebench.errors import MoebenchError
from moebench.cli.gate import gate_command
from moebench.cli.plan import plan_command


def _invoke(command, name, *args):
    app = typer.Typer()
    app.command(name)(command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, [name, *map(str, args)])
    if isinstance(result.exception, MoebenchError):
        return 2, result
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result


def gate(*args):
    return _invoke(gate_command, "gate", *args)


@pytest.fixture(autouse=True)
def _no_repo_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _rewrite(path, fn):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(fn(r)) + "\n" for r in rows))


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    """'all' at 3x, but the three trials' ratios swing 1.5x-6x: the interval spans 2x."""
    run = make_run(tmp_path_factory.mktemp("noisy"), configs=("baseline", "all"), speed={"all": 300.0})
    swing = {0: 2.0, 1: 1.0, 2: 0.5}

    def slow(r):
        if r["config"] == "all":
            r["decode_s"] *= swing[r["trial"]]
            r["wall_s"] = r["decode_s"] + 0.2
        return r
    _rewrite(run / "trials.jsonl", slow)
    (run / "steps.parquet").unlink()
    return run


def test_an_interval_across_the_threshold_is_inconclusive_not_a_regression(noisy, tmp_path):
    code, result = gate(noisy, "--metric", "decode", "--min-speedup", 2.0, "--junit", tmp_path / "j.xml")
    assert code == 3 and "gate: INCONCLUSIVE" in result.output, result.output
    assert "inconclusive: the interval spans" in result.output and "rerun with more --repeats" in result.output
    failure = ET.parse(tmp_path / "j.xml").getroot().find(".//failure")
    assert failure.get("type") == "GateInconclusive"
    code, result = gate(noisy, "--metric", "decode", "--min-speedup", 2.0, "--on-inconclusive", "warn",
                        "--junit", tmp_path / "j.xml")
    assert code == 0 and "gate: PASS, but 1 of" in result.output and "on_inconclusive = warn" in result.output
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("skipped")) == ("0", "1")
    policy = tmp_path / "p.toml"
    policy.write_text("[gate]\non_inconclusive = 'pass'\nmetric = 'decode'\nmin_speedup = 2.0\n")
    assert gate(noisy, "--policy", policy)[0] == 0
    # the whole interval below the threshold is shown, whatever on_inconclusive says: exit 1
    code, result = gate(noisy, "--metric", "decode", "--min-speedup", 50, "--on-inconclusive", "pass")
    assert code == 1 and "gate: FAIL" in result.output


def test_one_trial_has_no_interval_and_is_inconclusive(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"), trials=1)
    code, result = gate(run, "--metric", "decode", "--min-speedup", 1.5)
    assert code == 3 and "one trial gives no interval" in result.output
    assert gate(run, "--metric", "decode", "--min-speedup", 1.5, "--on-inconclusive", "warn")[0] == 0


def _approximate(run, name):
    manifest = json.loads((run / "manifest.json").read_text())
    for c in manifest["configs"]:
        if c["name"] == name:
            c["approximate"] = True
    (run / "manifest.json").write_text(json.dumps(manifest))


def test_approximate_configs_are_judged_by_their_verdict(tmp_path):
    # 2 of 40 answers changed (one lost, one gained): 40 items cannot rule out a 1-point drop
    few = make_run(tmp_path, run_id="few", configs=("baseline", "kernel"), flips={"kernel": [0, 1]})
    _approximate(few, "kernel")
    code, result = gate(few, "--metric", "decode", "--min-speedup", 1.5)
    assert code == 3, result.output  # inconclusive does not pass by default
    assert "accuracy kernel: verdict (margin 1)" in result.output and "identical outputs kernel" not in result.output
    assert "McNemar exact p" not in result.output  # trial 0's test decides nothing
    assert "items x 3 trials would show non-inferiority" in result.output  # what would decide it
    assert gate(few, "--metric", "decode", "--min-speedup", 1.5, "--on-inconclusive", "warn")[0] == 0
    # a wide enough margin makes the same run non-inferior
    assert gate(few, "--metric", "decode", "--min-speedup", 1.5, "--margin", 20)[0] == 0
    # the same two changed answers in an exact config fail the identity rule, as before
    exact = make_run(tmp_path, run_id="exact", configs=("baseline", "kernel"), flips={"kernel": [0, 1]})
    assert gate(exact, "--metric", "decode", "--min-speedup", 1.5, "--margin", 20)[0] == 1
    # a negative control that loses 12 answers: a regression, exit 1, approximate or not
    bad = make_run(tmp_path, run_id="bad", configs=("baseline", "kernel"), flips={"kernel": list(range(1, 13))})
    _approximate(bad, "kernel")
    code, result = gate(bad, "--metric", "decode", "--min-speedup", 1.5)
    assert code == 1 and "regression" in result.output


def test_plan_prints_both_figures_and_their_answer_models():
    code, result = _invoke(plan_command, "plan", "--items", 200, "--baseline-accuracy", 0.9, "--trials", 5)
    assert code == 0
    out = " ".join(result.output.split())
    assert "3.8 points if the config's outputs equal the baseline's" in out  # k^2 / (200 + k^2)
    assert "381 if no answer changes" in out and "like fresh samples" in out
    big = " ".join(_invoke(plan_command, "plan", "--items", 1319, "--baseline-accuracy", 0.9)[1].output.split())
    assert "1.0 points if the config's outputs equal" in big  # never below the margin
    told = _invoke(plan_command, "plan", "--items", 1319, "--baseline-accuracy", 0.9, "--discordance", 0.05)[1]
    assert "5.0% of pairs discordant per trial, as you said" in " ".join(told.output.split())


@pytest.mark.parametrize("args", [("--items", 0, "--baseline-accuracy", 0.9),
                                  ("--items", 48, "--baseline-accuracy", 90),
                                  ("--items", 48, "--baseline-accuracy", 0.9, "--trials", 0),
                                  ("--items", 48, "--baseline-accuracy", 0.9, "--margin", -1),
                                  ("--items", 48, "--baseline-accuracy", 0.9, "--discordance", 1.5)])
def test_plan_refuses_bad_input(args):
    assert _invoke(plan_command, "plan", *args)[0] == 2


def test_the_interval_in_summary_json_is_checked_against_the_raw_files(tmp_path):
    from moebench.results.summary import build_summary

    run = make_run(tmp_path, configs=("baseline", "kernel"))
    summary = build_summary(run)
    older = json.loads(json.dumps(summary))
    del older["configs"][1]["vs_baseline"]["accuracy_difference"]  # written before the field existed
    (run / "summary.json").write_text(json.dumps(older))
    assert gate(run, "--metric", "decode", "--min-speedup", 1.5)[0] == 0
    summary["configs"][1]["vs_baseline"]["accuracy_difference"]["ci95"] = [-0.1, 0.1]
    (run / "summary.json").write_text(json.dumps(summary))
    code, result = gate(run, "--metric", "decode", "--min-speedup", 1.5)
    assert code == 2 and "accuracy_difference.ci95[0]" in str(result.exception)


def test_the_policy_keys_are_checked_and_retired_ones_say_what_replaces_them(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"))
    assert gate(run, "--margin", 0)[0] == 2
    assert gate(run, "--on-inconclusive", "maybe")[0] == 2
    for bad in ("margin = 'one'", "on_inconclusive = 'yes'", "margin = 150"):
        policy = tmp_path / "p.toml"
        policy.write_text(f"[gate]\n{bad}\n")
        code, result = gate(run, "--policy", policy)
        assert code == 2, bad
    for old, says in (("max_accuracy_drop = 0.5", "set margin = 0.5"), ("mcnemar_alpha = 0.05", "no longer decides"),
                      ("require_power = true", 'on_inconclusive = "fail"')):
        policy.write_text(f"[gate]\n{old}\n")
        code, result = gate(run, "--policy", policy)
        assert code == 2 and "retired" in str(result.exception) and says in str(result.exception), old
