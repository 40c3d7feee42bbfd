"""build_summary on synthetic results directories with known answers."""

import json

import pytest

from fixtures.make_run import make_run
from moebench.errors import MoebenchError
from moebench.results.summary import SCHEMA, build_summary, config_entry, verdict


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs"), configs=("baseline", "kernel", "all"),
                    speed={"kernel": 200.0, "all": 300.0},
                    flips={"all": [1, 2]}, diverge={"kernel": [5, 7]})


@pytest.fixture(scope="module")
def summary(run_dir):
    return build_summary(run_dir)


def test_schema_and_fields(summary):
    assert summary["schema"] == SCHEMA
    assert summary["run_id"] == "fixture-run"
    assert summary["baseline"] == "baseline"
    assert [c["name"] for c in summary["configs"]] == ["baseline", "kernel", "all"]
    for c in summary["configs"]:
        for key in ("name", "kernel", "scheduler", "prefetch", "decode_tokens_per_s",
                    "output_tokens_per_s", "accuracy", "latency", "output_tokens", "truncations",
                    "errors", "activation", "batching", "expert_store", "roofline", "expert_load"):
            assert key in c, key
        assert set(c["decode_tokens_per_s"]) >= {"median", "ci95", "trials"}
        assert len(c["decode_tokens_per_s"]["trials"]) == 3
        assert set(c["accuracy"]) >= {"correct", "total", "value", "ci95"}
        assert set(c["latency"]) == {"ttft_s", "tpot_s", "itl_s", "latency_s"}
        assert set(c["latency"]["ttft_s"]) == {"mean", "p50", "p95", "p99"}
        assert c["truncations"] == 1 and c["errors"] == 0
        assert c["activation"]["ok"] is True
        assert ("vs_baseline" in c) == (c["name"] != "baseline")
    json.dumps(summary, allow_nan=False)  # strict JSON: no NaN leaks


def test_speedup_and_accuracy(summary):
    base, kernel, all_ = (config_entry(summary, n) for n in ("baseline", "kernel", "all"))
    assert base["decode_tokens_per_s"]["median"] == pytest.approx(100, rel=0.02)
    sp = kernel["vs_baseline"]["speedup"]
    assert sp["median"] == pytest.approx(2.0, rel=0.02)
    assert sp["ci95"][0] <= sp["median"] <= sp["ci95"][1]
    assert all_["vs_baseline"]["speedup"]["median"] == pytest.approx(3.0, rel=0.02)
    # pytest >= 9.2 rejects approx() on nested dicts (accuracy holds a ci95 list): compare the fields
    assert (base["accuracy"]["correct"], base["accuracy"]["total"]) == (36, 40)
    assert base["accuracy"]["value"] == pytest.approx(0.9)
    assert base["accuracy"]["trials_agree"] is True

    vk = kernel["vs_baseline"]
    assert vk["identical_outputs"] == pytest.approx(38 / 40)
    assert vk["discordant"] == {"baseline_only": 0, "config_only": 0}
    assert vk["mcnemar_p"] == 1.0 and vk["accuracy_delta"] == 0
    assert [d["item_id"] for d in vk["first_divergence"]] == ["synth/5", "synth/7"]
    assert vk["first_divergence"][0]["position"] == len("Item 5: ")

    va = all_["vs_baseline"]
    assert va["discordant"] == {"baseline_only": 2, "config_only": 0}
    assert va["mcnemar_p"] == pytest.approx(0.5)
    assert va["accuracy_delta"] == pytest.approx(-5.0)
    # Tango's score interval of 0 gained and 2 lost of 40 (its bounds solved independently in
    # tests/results/test_verdict.py); the old percentile bootstrap gave [-12.5, 0]: no room for a gain
    lo, hi = va["accuracy_delta_ci95"]
    assert (lo, hi) == (pytest.approx(-16.504, abs=1e-3), pytest.approx(4.200, abs=1e-3))
    # Three greedy trials repeat the same answers: clustered by item, they count as one
    diff = va["accuracy_difference"]
    assert (diff["items"], diff["pairs"], diff["trials"], diff["design_effect"]) == (40, 120, 3, 3.0)
    assert diff["ci95"] == [pytest.approx(lo), pytest.approx(hi)]
    assert diff["discordant"] == {"baseline_only": 6, "config_only": 0}
    assert va["accuracy_verdict"]["verdict"] == "inconclusive"  # 40 items cannot rule out 1 point
    assert va["accuracy_verdict"]["margin"] == 1.0
    assert "would have been called a regression in >= 80% of runs like this one" in va["accuracy_verdict"]["statement"]
    assert vk["accuracy_verdict"]["verdict"] == "inconclusive"  # two outputs differ: not identical
    assert va["differing_answers"] == 2


def test_steps_derived_metrics(summary):
    c = config_entry(summary, "all")
    assert c["batching"]["mean_batch_size"] == pytest.approx(8, abs=0.2)
    assert c["batching"]["p95_queue_wait_s"] == pytest.approx(0.05)
    assert c["expert_store"]["prefetch_precision"] == pytest.approx(0.8)
    assert config_entry(summary, "baseline")["expert_store"]["prefetch_precision"] is None
    rf = c["roofline"]
    assert rf["limit_tokens_per_s"] > 0
    assert rf["achieved_fraction"] == pytest.approx(c["decode_tokens_per_s"]["median"] / rf["limit_tokens_per_s"])
    assert len(c["expert_load"]) == 4 and len(c["expert_load"][0]) == 16


def test_verdict(summary):
    assert summary["optimized"] == "all"
    text = summary["verdict"]
    assert text.startswith("speedup 3.00x in decode tok/s (95% CI")
    assert "no accuracy change detected: 2 of 40 answers differ" in text
    assert "McNemar p = 0.5" in text
    assert "McNemar p = 1.0" in verdict(summary, "kernel")
    assert verdict(summary, "baseline") == "baseline is the baseline"


def test_reproducible(run_dir, summary):
    assert build_summary(run_dir) == summary


def test_two_trials_get_a_t_interval_over_trials_not_steps(tmp_path):
    """Two trials: the interval is a Student t interval over the two trials (12.7 x their spread),
    not a bootstrap over decode steps that treats steps as independent."""
    s = build_summary(make_run(tmp_path, configs=("baseline", "kernel"), trials=2))
    k = config_entry(s, "kernel")
    block = k["decode_tokens_per_s"]
    assert block["ci_method"].startswith("Student t interval on the mean log of 2 per-trial rates")
    lo, hi = block["ci95"]
    assert lo < block["median"] < hi
    sp = k["vs_baseline"]["speedup"]
    assert "2 per-trial paired ratios" in sp["ci_method"]
    assert len(sp["trials"]) == 2
    assert sp["ci95"][0] <= sp["median"] <= sp["ci95"][1]
    assert s["intervals"]["trials"] == 2
    one = build_summary(make_run(tmp_path / "one", configs=("baseline", "kernel"), trials=1))
    k1 = config_entry(one, "kernel")
    assert k1["decode_tokens_per_s"]["ci95"] is None and k1["vs_baseline"]["speedup"]["ci95"] is None
    assert "no confidence interval: one trial" in one["verdict"]


def test_whole_run_output_throughput_beside_decode(summary):
    """Output tok/s over each trial's whole wall time (prefill included), with its own interval and
    speedup, next to the decode-only figures."""
    k = config_entry(summary, "kernel")
    out = k["output_tokens_per_s"]
    assert set(out) >= {"median", "ci95", "trials", "ci_method"} and len(out["trials"]) == 3
    assert out["median"] < k["decode_tokens_per_s"]["median"]  # the prefill time counts
    osp = k["vs_baseline"]["output_speedup"]
    assert 1.0 < osp["ci95"][0] <= osp["median"] <= osp["ci95"][1] < k["vs_baseline"]["speedup"]["median"]
    assert "output tok/s over the whole run" in summary["verdict"]


def test_missing_optional_files(tmp_path):
    no_steps = build_summary(make_run(tmp_path / "a", write_steps=False))
    c = config_entry(no_steps, "kernel")
    assert c["batching"]["mean_batch_size"] is None and c["roofline"]["limit_tokens_per_s"] is None
    assert c["vs_baseline"]["speedup"]["median"] == pytest.approx(2.0, rel=0.02)

    no_trials = build_summary(make_run(tmp_path / "b", write_trials=False))
    c = config_entry(no_trials, "kernel")
    assert c["activation"]["ok"] is None and c["expert_load"] is None
    assert c["decode_tokens_per_s"]["median"] == pytest.approx(200, rel=0.02)  # from the steps

    neither = build_summary(make_run(tmp_path / "c", write_trials=False, write_steps=False))
    c = config_entry(neither, "kernel")
    assert c["decode_tokens_per_s"]["median"] is None
    assert c["vs_baseline"]["speedup"] == {"median": None, "ci95": None, "trials": [], "ci_method": None}
    assert c["accuracy"]["correct"] == 36
    assert "speedup unknown" in neither["verdict"]
    json.dumps(neither, allow_nan=False)


def test_inactive_optimization_flagged(tmp_path):
    s = build_summary(make_run(tmp_path, inactive=("kernel",)))
    k = config_entry(s, "kernel")
    assert k["activation"]["ok"] is False
    assert k["activation"]["errors"] == [f"trial {t}: kernel: no fused kernel calls recorded" for t in range(3)]
    assert k["vs_baseline"]["verdict"].startswith("NOT VALID")


def test_headline_is_fastest_without_all(tmp_path):
    s = build_summary(make_run(tmp_path, configs=("baseline", "kernel", "scheduler"),
                               speed={"kernel": 150.0, "scheduler": 250.0}))
    assert s["optimized"] == "scheduler"


def test_unusable_input_names_the_file(tmp_path):
    with pytest.raises(MoebenchError, match="manifest.json"):
        build_summary(tmp_path)
    run = make_run(tmp_path)
    with open(run / "samples.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(MoebenchError, match="samples.jsonl"):
        build_summary(run)
    run = make_run(tmp_path / "x")
    (run / "steps.parquet").write_bytes(b"garbage")
    with pytest.raises(MoebenchError, match="steps.parquet"):
        build_summary(run)
    run = make_run(tmp_path / "y")
    (run / "trials.jsonl").write_text('{"config": "baseline"}\n')
    with pytest.raises(MoebenchError, match="trials.jsonl.*trial"):
        build_summary(run)
    m = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**m, "baseline": "nope"}))
    with pytest.raises(MoebenchError, match="manifest.json.*baseline"):
        build_summary(run)


def test_load_summary_prefers_current_file_and_rebuilds_old(tmp_path):
    from moebench.results.summary import load_summary, read_summary

    run = make_run(tmp_path)
    built = build_summary(run)
    (run / "summary.json").write_text(json.dumps({**built, "run_id": "from-file"}))
    assert load_summary(run)["run_id"] == "from-file"
    assert load_summary(run / "summary.json")["run_id"] == "from-file"
    (run / "summary.json").write_text(json.dumps({**built, "schema": "moebench.summary/0"}))
    assert load_summary(run) == built  # rebuilt from the raw files
    with pytest.raises(MoebenchError, match="summary.json.*moebench.summary/1"):
        read_summary(run / "summary.json")


def test_errors_and_missing_fields(tmp_path):
    run = make_run(tmp_path, configs=("baseline", "kernel"))
    lines = (run / "samples.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    for r in rows:
        if r["config"] == "kernel" and r["item_id"] == "synth/11":
            r.update(correct=None, error="worker crashed", finish_reason="error", output="",
                     ttft_s=None, latency_s=None)
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trials = [json.loads(line) for line in (run / "trials.jsonl").read_text().splitlines()]
    for t in trials:
        t.pop("activation_ok")
    (run / "trials.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trials))
    s = build_summary(run)
    k = config_entry(s, "kernel")
    assert k["errors"] == 3 and k["accuracy"]["correct"] == 35
    assert k["vs_baseline"]["discordant"] == {"baseline_only": 1, "config_only": 0}
    assert k["activation"]["ok"] is None
    json.dumps(s, allow_nan=False)
