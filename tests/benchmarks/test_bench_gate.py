"""Smoke test of the gate benchmark (benchmarks/bench_gate.py): one tiny A/A run end to end, and
the injected slowdown reaching only the candidate's runtime. Speed is not judged here."""

import json
import math

import pytest

from benchmark_scripts import load_benchmark
from tiny_models import make_tiny_checkpoint, write_char_tokenizer

bench_gate = load_benchmark("bench_gate")
_configs, judge = bench_gate._configs, bench_gate.judge
results_table, run_bench, sweep_table = bench_gate.results_table, bench_gate.run_bench, bench_gate.sweep_table


def test_slowdown_reaches_only_the_candidate(tmp_path):
    """The benchmark hands measure() its own backend: the candidate runs a SlowedEngine whose sessions
    wrap the prefetch strategy; the baseline runs the plain engine; both have the same switches."""
    from moebench.engine import Engine, RuntimeConfig, load_checkpoint
    from moebench.measuring.measure import CheckpointVariants

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "model"))
    baseline, candidate = _configs()
    backend = bench_gate.SlowedBackend([baseline, candidate], CheckpointVariants(ckpt), None, RuntimeConfig(),
                                       slowdown=0.15)
    with backend.session(candidate) as slowed_engine, backend.session(baseline) as plain_engine:
        assert isinstance(slowed_engine, bench_gate.SlowedEngine) and slowed_engine.slowdown == 0.15
        assert type(plain_engine) is Engine
        assert slowed_engine.runtime.switches() == plain_engine.runtime.switches()
        _, slowed = slowed_engine.store_and_prefetcher()
        _, plain = plain_engine.store_and_prefetcher()
    assert isinstance(slowed, bench_gate.SlowedPrefetcher) and slowed.slowdown == 0.15 and slowed.last == 1
    assert not isinstance(plain, bench_gate.SlowedPrefetcher)
    assert slowed.evidence() == plain.evidence()  # everything but the extra work is the wrapped one's
    with bench_gate.SlowedBackend([baseline, candidate], CheckpointVariants(ckpt), None, RuntimeConfig()
                                  ).session(candidate) as aa_engine:
        assert type(aa_engine) is Engine  # A/A: no slowdown, the plain engine for both


def test_the_slowed_engine_does_extra_work_inside_the_timed_step(tmp_path):
    """The extra compute lands inside the engine's step, in its forward (the timed region whose
    forward_s the step records), not around it. Compared forward to forward: the step's own
    bookkeeping, which the slowdown does not scale, is a large part of a tiny model's step."""
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "model"))
    rt = RuntimeConfig(batch_size=1, max_new_tokens=6)
    requests = [Request(id="r", prompt="", max_new_tokens=6)]

    def decode_forward_seconds(engine):
        res = engine.generate(requests, prompt_ids=[[1, 2, 3]])
        decode = [s for s in res.steps if s["phase"] == "decode"]
        assert all(s["forward_s"] <= s["duration_s"] for s in decode)  # the forward is inside the step's time
        return sum(s["forward_s"] for s in decode), res

    plain_s, plain = decode_forward_seconds(Engine(ckpt, None, rt))
    slowed_s, slowed = decode_forward_seconds(bench_gate.SlowedEngine(ckpt, None, rt, slowdown=3.0))
    assert [c.output_ids for c in slowed.completions] == [c.output_ids for c in plain.completions]
    assert slowed_s > 2 * plain_s  # 3x the forward's time of extra work in every forward


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
