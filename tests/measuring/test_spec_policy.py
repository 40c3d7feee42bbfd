"""The batch-size policy's measured default (docs/speculative.md, "Policy"): `moebench run
--speculative ngram` drafts only in steps of one sequence unless told otherwise, mtp in any batch,
and the manifest records the limit the run used and where it came from."""

import json
import sys

import pytest

from moebench.engine.speculative import DEFAULT_MAX_BATCH


def _run(monkeypatch, tmp_path, run_id, *extra):
    from moebench.cli.app import main

    monkeypatch.setattr(sys, "argv", ["moebench", "run", "--speculative", "ngram", "--limit", "3", "--max-new-tokens", "24",
                                      "--warmup", "0", "--repeats", "1", "--offload-tier", "host", "--out", str(tmp_path),
                                      "--run-id", run_id, *extra])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code in (0, None)
    d = tmp_path / run_id
    manifest = json.loads((d / "manifest.json").read_text())
    trial = json.loads((d / "trials.jsonl").read_text().splitlines()[0])
    return manifest["runtime"]["speculative"], trial["evidence"]["speculative"]


def test_the_default_limit_is_recorded_and_lets_a_batch_of_one_draft(monkeypatch, tmp_path):
    assert DEFAULT_MAX_BATCH == {"ngram": 1, "mtp": None}
    record, ev = _run(monkeypatch, tmp_path, "b1", "--batch-size", "1")
    assert record["method"] == "ngram" and record["max_batch"] == 1
    assert record["max_batch_from"] == "the method's default"
    assert ev["max_batch"] == 1 and ev["steps_off_by_batch"] == 0 and ev["drafted"] > 0


def test_a_larger_limit_is_recorded_and_drafts_in_full_batches(monkeypatch, tmp_path):
    record, ev = _run(monkeypatch, tmp_path, "b3", "--batch-size", "3", "--spec-max-batch", "3")
    assert record["max_batch"] == 3 and ev["steps_off_by_batch"] == 0 and ev["drafted"] > 0
    assert record["max_batch_from"] == "--spec-max-batch"
