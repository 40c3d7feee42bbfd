"""What the report says in words: the model by name without this machine's path, and a config whose
switch was not exercised is never called fine."""


def test_the_report_names_the_model_without_this_machines_path(tmp_path):
    import json

    from fixtures.make_run import make_run
    from moebench.results.report import build_document, render_markdown
    from moebench.results.summary import build_summary, load_run

    run = make_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["model"]["path"] = "/work/someone/harness/bundled/gsm-synth-moe"
    (run / "manifest.json").write_text(json.dumps(manifest))
    md = render_markdown(build_document(build_summary(run), load_run(run).samples, []))
    assert "gsm-synth-moe" in md and "/work/someone" not in md


def test_the_report_says_not_exercised_never_ok(tmp_path):
    import json

    from fixtures.make_run import make_run
    from moebench.results.report import build_document, render_markdown
    from moebench.results.summary import build_summary, load_run

    run = make_run(tmp_path, configs=("baseline", "kernel", "all"))
    rows = [json.loads(line) for line in (run / "trials.jsonl").read_text().splitlines()]
    for r in rows:
        r["not_exercised"] = ["scheduler=continuous not exercised: 4 requests fit one batch of 8"] \
            if r["config"] == "all" else []
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = render_markdown(build_document(build_summary(run), load_run(run).samples, []))
    assert "Not exercised in all" in md and "Every configuration showed evidence" not in md
    assert "| not exercised |" in md  # the per-config table's activation column
    assert "Student t interval on the logs of the 3 per-trial values" in md
