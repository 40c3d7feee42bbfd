"""write_report / report_command on synthetic runs: every file, escaped model text, embedded plots."""

import re

import pytest
import typer
from typer.testing import CliRunner

from fixtures.make_run import make_run
from moebench.cli.report import report_command
from moebench.results.report import write_report

EVIL = '<script>alert("x")</script> ``` <img src=x onerror=alert(1)> #### 1001'
PLOTS = {"accuracy_forest.png", "speedup_forest.png", "decode_tps.png", "waterfall.png", "accuracy.png", "latency_cdf.png", "output_length.png",
         "expert_load.png", "distinct_experts.png", "expert_store.png", "roofline.png"}


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("report")(report_command)
    app.command("noop")(lambda: None)  # two commands, so typer keeps the subcommand name
    return app


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    run = make_run(root, configs=("baseline", "kernel", "kernel+scheduler", "all"),
                   speed={"kernel": 150.0, "kernel+scheduler": 180.0, "all": 220.0},
                   flips={"all": [1]}, outputs={("all", 1): EVIL})
    cwd = root / "cwd"
    cwd.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        result = CliRunner().invoke(_app(), ["report", str(run)])
    assert result.exit_code == 0, result.output
    out = cwd / "reports" / "fixture-run"
    assert "reports/fixture-run/report.md" in result.output.replace("\n", "")
    return out


def test_writes_every_file(report_dir):
    names = {p.name for p in report_dir.iterdir()}
    assert {"report.md", "report.html"} | PLOTS <= names
    for name in PLOTS:
        assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_is_self_contained_and_escaped(report_dir):
    text = (report_dir / "report.html").read_text()
    assert "<script" not in text.lower()
    assert "<img src=x" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    assert len(re.findall(r'src="data:image/png;base64,', text)) == len(PLOTS)
    assert 'src="' not in text.replace('src="data:image/png;base64,', "")  # no external files


def test_markdown_content(report_dir):
    md = (report_dir / "report.md").read_text()
    assert "| metric | baseline (baseline) | optimized (all) | change |" in md
    for row in ("Decode tokens/s", "Accuracy (correct / total; change: paired difference, all trials)",
                "McNemar exact p, trial 0", "Mean latency",
                "P50 latency", "P95 latency", "Mean TTFT", "Output length P50 / P95", "Errors / truncations"):
        assert f"| {row}" in md
    assert "**speedup 2.20x" in md
    # the change column prints the paired speedup, the estimator of the verdict and the gate
    decode_row = next(line for line in md.splitlines() if line.startswith("| Decode tokens/s"))
    assert "+120% (speedup 2.20x" in decode_row
    assert "What this run proves" in md and "Examples of differing outputs" in md
    # "all" changed one answer of 40 (an exact config, so no shortcut): too few items to judge
    assert "inconclusive: difference" in md and "reaches below the -1-point margin" in md
    assert "points or more would have been called a regression in >= 80% of runs" in md
    assert "| config | items x trials | answers lost / won | Δ points [95% CI] |" in md
    assert "trials exchangeable?" in md and "it decides nothing" in md
    assert "| kernel | 40 x 3 | 0 / 0 | +0.00 [-8.76, +8.76] |" in md  # identical outputs: interval still stated
    assert "all, item synth/1: first difference at character" in md
    assert "````" in md  # the fence outgrows the ``` inside the model output
    # Outside code fences the model text never appears raw.
    outside = re.sub(r"(`{3,})\n.*?\n\1", "", md, flags=re.S)
    assert "<script>" not in outside


def test_report_without_steps_or_trials(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"), write_steps=False, write_trials=False)
    out = write_report(run, tmp_path / "out")
    names = {p.name for p in out.iterdir()}
    assert {"report.md", "report.html", "accuracy.png", "latency_cdf.png"} <= names
    assert "roofline.png" not in names and "decode_tps.png" not in names
    assert "speedup unknown" in (out / "report.md").read_text()


def test_margin_rejudges_the_verdicts(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "all"), flips={"all": [1]})
    wide = (write_report(run, tmp_path / "wide", margin=25) / "report.md").read_text()
    assert "non-inferior at a 25-point margin" in wide
    narrow = (write_report(run, tmp_path / "narrow") / "report.md").read_text()
    assert "non-inferior at" not in narrow and "inconclusive: difference" in narrow
