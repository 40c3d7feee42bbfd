"""Smoke test of the gate benchmark (benchmarks/bench_gate.py): one tiny A/A run end to end, and
the injected slowdown reaching only the candidate's runtime. Speed is not judged here."""

import json
import math

import pytest

from benchmark_scripts import load_benchmark
from tiny_models import make_tiny_checkpoint, write_char_tokenizer

bench_gate = load_benchmark("bench_gate")
_candidate_extra, _configs, judge = bench_gate._candidate_extra, bench_gate._configs, bench_gate.judge
results_table, run_bench, sweep_table = bench_gate.results_table, bench_gate.run_bench, bench_gate.sweep_table


def test_slowdown_reaches_only_the_candidate():
    import moebench.ablation as ablation_mod
    from moebench.engine import RuntimeConfig

    original = ablation_mod.runtime_for
    base = RuntimeConfig()
    baseline, candidate = _configs()
    with _candidate_extra({"inject_slowdown": 0.15}, quiet=True):
        runtime_for = ablation_mod.runtime_for
        assert runtime_for(base, candidate).inject_slowdown == 0.15
        assert not hasattr(runtime_for(base, baseline), "inject_slowdown")
        assert runtime_for(base, candidate).switches() == runtime_for(base, baseline).switches()
    assert ablation_mod.runtime_for is original


def test_the_slowdown_wraps_the_candidates_prefetcher_not_the_engine(tmp_path):
    """The engine's step has no test hook; the benchmark wraps the candidate's prefetch strategy."""

    import moebench.engine.llm_engine as engine_mod
    SlowedPrefetcher = bench_gate.SlowedPrefetcher
    from moebench.engine import RuntimeConfig, load_checkpoint

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "model"))
    with _candidate_extra({"inject_slowdown": 0.15}, quiet=True):
        _, slowed = engine_mod.make_store_and_prefetcher(ckpt, bench_gate.SlowedRuntime(inject_slowdown=0.15))
        _, plain = engine_mod.make_store_and_prefetcher(ckpt, RuntimeConfig())
    assert isinstance(slowed, SlowedPrefetcher) and slowed.slowdown == 0.15 and slowed.last == 1
    assert not isinstance(plain, SlowedPrefetcher)
    assert slowed.evidence() == plain.evidence()  # everything but the extra work is the wrapped one's


def test_one_tiny_aa_run(tmp_path, gsm8k_dir):
    model = make_tiny_checkpoint(tmp_path / "model")
    write_char_tokenizer(model)
    out = run_bench(runs=1, scenarios=("aa",), model=model, suite="gsm8k", data=gsm8k_dir, items=4,
                    repeats=2, batch_size=4, max_new_tokens=8, workdir=tmp_path / "work", keep=True,
                    progress=False)
    json.dumps(out, allow_nan=False)  # the --out file is plain JSON

    assert out["schema"] == "moebench.bench_gate/1"
    assert out["settings"]["items"] == 4 and out["settings"]["repeats"] == 2
    assert set(out["scenarios"]) == {"aa"}
    aa = out["scenarios"]["aa"]
    assert aa["runs"] == 1 and aa["gate_failures"] in (0, 1) and aa["rate"] == aa["gate_failures"]
    (run,) = out["runs"]
    assert run["scenario"] == "aa" and isinstance(run["gate_passed"], bool)
    sp = run["speedup"]
    assert sp["median"] > 0 and math.isfinite(sp["median"])
    assert "2 per-trial paired ratios" in sp["ci_method"]  # 2 trials: a t interval over them
    assert sp["ci95"][0] <= sp["median"] <= sp["ci95"][1]
    assert len(run["trial_ratios"]) == 2
    names = [r["name"] for r in run["rules"]]
    assert "speedup candidate (decode tok/s) vs committed baseline" in names
    assert "identical outputs candidate" in names  # the whole gate is judged, not only speed
    assert run["failed_rules"] == [r["name"] for r in run["rules"] if not r["passed"]]
    # A/A with the same switches: same greedy outputs, so only a speed rule could fail.
    assert all(r["passed"] for r in run["rules"] if not r["name"].startswith("speedup"))
    assert len(out["threshold_sweep"]) == 10
    assert {"max_false_alarms", "false_alarms_ok", "met"} <= set(out["targets"])
    assert (tmp_path / "work" / "aa-000" / "summary.json").is_file()

    # The same verdict again from the summary on disk, and both rule kinds evaluate.
    summary = json.loads((tmp_path / "work" / "aa-000" / "summary.json").read_text())
    assert judge(summary, "regression", 0.05)[0] == run["gate_passed"]
    assert isinstance(judge(summary, "noninferiority", 0.05)[0], bool)
    results_table(out), sweep_table(out)


def test_unknown_rule_is_rejected():
    with pytest.raises(ValueError, match="unknown rule"):
        run_bench(runs=1, rule="bogus")
