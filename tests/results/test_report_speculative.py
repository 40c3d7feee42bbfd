"""The report's speculative plot: drawn from `activation.evidence.speculative` of summary.json (the
engine's own evidence record, engine/speculative.py), and absent, with the rest of the report
unchanged, for a run without speculative configs."""

import json

from fixtures.make_run import make_run
from moebench.engine.speculative import Speculator, SpecSettings
from moebench.results.plots import speculative_acceptance
from moebench.results.plots_speculative import FILE, speculative_records
from moebench.results.report import write_report
from moebench.results.summary import build_summary


def _spec_evidence(max_batch=None) -> dict:
    """The engine's evidence record (its keys and settings) with the counts of a K = 4 run."""
    ev = Speculator(SpecSettings("ngram", 4, max_batch)).evidence()
    ev.update(verify_steps=210, plain_decode_steps=90, drafted=600, accepted=91,
              drafted_by_position=[200, 160, 140, 100], acceptance_by_position=[0.31, 0.15, 0.08, 0.05],
              accepted_length_histogram=[138, 45, 10, 5, 2], tokens_per_verify=1.455, acceptance_rate=91 / 600)
    return ev


def _with_speculative(run, config: str, evidence: dict) -> None:
    """Give `config`'s trials the speculative evidence the engine records."""
    path = run / "trials.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        if row["config"] == config:
            row["evidence"]["speculative"] = evidence
        else:
            row["evidence"]["speculative"] = {"method": "off"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_plot_is_drawn_from_the_summary_speculative_evidence(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"))
    _with_speculative(run, "kernel", _spec_evidence(max_batch=1))
    summary = build_summary(run)
    records = speculative_records(summary)
    assert [name for name, _ in records] == ["kernel"]  # method off is not plotted
    assert records[0][1]["acceptance_by_position"] == [0.31, 0.15, 0.08, 0.05]
    out = write_report(run, tmp_path / "report")
    png = out / FILE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "acceptance by draft position and tokens per verify step" in md
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len([p for p in out.iterdir() if p.suffix == ".png"])


def test_a_run_without_speculative_configs_reports_as_before(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"))
    out = write_report(run, tmp_path / "report")
    assert not (out / FILE).exists()
    assert "draft position" not in (out / "report.md").read_text()
    # a speculative config whose evidence has no drafted positions (off, or nothing recorded) draws nothing
    assert speculative_acceptance(build_summary(run), tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()


def test_a_stale_plot_is_removed_when_the_run_has_no_speculation(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"))
    out = tmp_path / "report"
    out.mkdir()
    (out / FILE).write_bytes(b"old")
    write_report(run, out)
    assert not (out / FILE).exists()
