"""Offered load (issue 49): seeded arrival schedules, the engine's open loop, load sweeps within a
run's trials, the summary's serving block, the gate's latency rule, and a closed-loop run unchanged.
Real runs of the bundled model; the client's timing accuracy is measured by benchmarks, not here."""

import json
import math

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from moebench.cli.gate import gate_command
from moebench.cli.run import run_command
from moebench.errors import MoebenchError
from moebench.measuring.arrivals import Load, loads_from_args, parse_fluctuation, parse_rates, parse_slos, read_trace


def cli(tmp_path, *args, command="run"):
    app = typer.Typer()
    app.command("run")(run_command)
    app.command("gate")(gate_command)
    result = CliRunner().invoke(app, [command, *map(str, args)])
    code = 2 if isinstance(result.exception, MoebenchError) else result.exit_code
    return code, result


def run(tmp_path, *args):
    code, result = cli(tmp_path, "--max-new-tokens", 8, "--warmup", 2, "--out", tmp_path, "--run-id", "r", *args)
    return code, tmp_path / "r", result


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- schedules

def test_a_schedule_is_the_same_for_every_call_and_new_for_every_load_and_seed():
    load = parse_rates("8")[0]
    a, b = load.offsets(300, 0), load.offsets(300, 0)
    assert a == b and a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    assert a != load.offsets(300, 1)
    assert a != parse_rates("8", burstiness=0.5)[0].offsets(300, 0)
    assert parse_rates("inf")[0].offsets(300, 0) is None


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gaps_have_the_rate_and_the_burstiness_asked_for(burstiness):
    gaps = np.diff(parse_rates("10", burstiness)[0].offsets(20_001, 7))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # gamma with shape k: coefficient of variation 1/sqrt(k) (1: Poisson)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_a_fluctuating_load_alternates_its_two_rates():
    load = parse_fluctuation("2,8,5")
    t = np.asarray(load.offsets(4000, 0))
    phase = (t // 5).astype(int) % 2  # 0: the low phase, 1: the high one
    full = t < (t[-1] // 10) * 10  # whole cycles only
    low, high = np.sum(full & (phase == 0)), np.sum(full & (phase == 1))
    assert high / low == pytest.approx(4.0, rel=0.1)
    assert load.to_dict()["fluctuate"] == {"low": 2.0, "high": 8.0, "period_s": 5.0}


def test_a_trace_is_read_as_send_times_from_its_first(tmp_path):
    f = tmp_path / "trace.txt"
    f.write_text("# seconds\n10.0\n10.5\n12\n")
    load = read_trace(str(f))
    assert load.offsets(3, 0) == [0.0, 0.5, 2.0]
    with pytest.raises(MoebenchError, match="3 arrival times for 4 requests"):
        load.offsets(4, 0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(request_rate="0"), "must be > 0"),
    (dict(request_rate="fast"), "not a number"),
    (dict(request_rate="4,4"), "given twice"),
    (dict(request_rate="4", burstiness=0.0), "--burstiness must be > 0"),
    (dict(burstiness=2.0), "--burstiness needs"),
    (dict(fluctuate="8,2,5"), "LOW <= HIGH"),
    (dict(fluctuate="2,8"), "LOW,HIGH,SECONDS"),
])
def test_bad_loads_are_refused(kwargs, message):
    args = dict(request_rate=None, burstiness=1.0, fluctuate=None, arrivals=None) | kwargs
    with pytest.raises(MoebenchError, match=message):
        loads_from_args(**args)


def test_slos_are_parsed_and_checked():
    assert parse_slos(["ttft=0.5", "tpot=0.05", "e2e=3"]) == {"ttft_s": 0.5, "tpot_s": 0.05, "latency_s": 3.0}
    for bad in (["ttft"], ["ttft=-1"], ["itl=0.1"], ["ttft=1", "ttft=2"]):
        with pytest.raises(MoebenchError):
            parse_slos(bad)


# ---------------------------------------------------------------- the engine

def test_the_open_loop_gives_each_request_at_its_time_and_the_closed_loop_answers(checkpoints, tokenizer):
    from moebench.engine import Engine, Request
    from moebench.engine.config import RuntimeConfig
    from moebench.suites import load_suite

    rt = RuntimeConfig(scheduler="continuous", max_new_tokens=12, batch_size=4)
    suite = load_suite("gsm-synth", limit=10)
    requests = [Request(it.id, suite.prompt(it), 12, tuple(suite.stop)) for it in suite.items]
    engine = Engine(checkpoints(rt), tokenizer, rt)
    closed = engine.generate(requests)
    arrivals = Load("t", 40.0).offsets(len(requests), 3)
    opened = engine.generate(requests, arrivals=arrivals)
    assert [c.id for c in opened.completions] == [r.id for r in requests]
    assert [c.scheduled_s for c in opened.completions] == arrivals
    # the thread that hands requests over is late, never early; the engine's clock starts at 0
    assert all(c.sent_s >= c.scheduled_s for c in opened.completions)
    assert opened.wall_s >= arrivals[-1]
    assert all(c.scheduled_s is None for c in closed.completions)
    # the continuous scheduler's outputs do not depend on what shares the batch
    assert [c.output_ids for c in opened.completions] == [c.output_ids for c in closed.completions]


# ---------------------------------------------------------------- a run with loads

def test_a_rate_sweep_runs_every_load_in_every_trial_and_the_gate_judges_latency(tmp_path):
    code, run_dir, result = run(tmp_path, "--ablate", "--axes", "scheduler", "--limit", 6, "--repeats", 2,
                                "--request-rate", "30,inf", "--fluctuate", "10,40,0.1", "--slo", "ttft=5",
                                "--slo", "tpot=1")
    assert code == 0, result.output
    manifest = json.loads((run_dir / "manifest.json").read_text())
    labels = [ld["label"] for ld in manifest["loads"]]
    assert labels == ["30/s", "inf", "10-40/s every 0.1s"] and manifest["primary_load"] == "inf"
    assert manifest["loads"][1]["arrivals_s"] is None and len(manifest["loads"][0]["arrivals_s"]) == 6
    trials = records(run_dir / "trials.jsonl")
    assert sorted((r["config"], r["trial"], r["load"]) for r in trials) == sorted(
        (c, t, ld) for c in ("baseline", "scheduler") for t in (0, 1) for ld in labels)
    samples = records(run_dir / "samples.jsonl")
    assert len(samples) == 2 * 2 * 3 * 6
    for s in samples:
        if s["load"] != "inf":  # every config and trial got the manifest's arrival times
            i = [it["label"] for it in manifest["loads"]].index(s["load"])
            assert s["scheduled_s"] in manifest["loads"][i]["arrivals_s"]
            assert s["sent_s"] >= s["scheduled_s"]
    summary = json.loads((run_dir / "summary.json").read_text())
    # accuracy and speedups are the closed loop's: 6 items, two trials
    assert summary["configs"][0]["accuracy"]["total"] == 6
    serving = summary["serving"]
    assert serving["slo"] == {"ttft_s": 5.0, "tpot_s": 1.0}
    point = serving["configs"]["scheduler"]["30/s"]
    assert point["trials"] == 2 and point["requests"] == 12
    assert point["goodput_rps"]["mean"] > 0 and point["slo_attainment"] == 1.0
    assert point["send_lag_s"]["p99"] >= 0
    assert len(point["vs_baseline"]["p99_ttft_ratio"]["trials"]) == 2
    assert serving["configs"]["baseline"]["10-40/s every 0.1s"]["stability"]["window_s"] == 0.1
    assert "send_lag_s" not in serving["configs"]["baseline"]["inf"]

    code, result = cli(tmp_path, run_dir, "--max-ttft-rise", "100", "--min-speedup", "0.01",
                       "--on-inconclusive", "warn", command="gate")
    assert "latency scheduler: P99 TTFT ratio" in result.output and "@ 30/s" in result.output, result.output
    assert code in (0, 1), result.output


def test_a_closed_loop_run_writes_no_load_records(tmp_path):
    code, run_dir, result = run(tmp_path, "--limit", 3, "--ablate", "--axes", "scheduler", "--repeats", 1)
    assert code == 0, result.output
    assert "loads" not in json.loads((run_dir / "manifest.json").read_text())
    assert all("load" not in r and "scheduled_s" not in r for r in records(run_dir / "samples.jsonl"))
    assert all("load" not in r for r in records(run_dir / "trials.jsonl"))
    assert "serving" not in json.loads((run_dir / "summary.json").read_text())
    code, result = cli(tmp_path, run_dir, "--max-ttft-rise", "0.1", "--on-inconclusive", "fail",
                       command="gate")
    assert code == 3 and "closed-loop run" in result.output, result.output


def test_a_bad_load_is_one_line_and_exit_2_before_anything_runs(tmp_path):
    code, _, result = run(tmp_path, "--limit", 3, "--request-rate", "-1")
    assert code == 2 and not (tmp_path / "r").exists()


def test_the_latency_rule_judges_every_load_and_never_passes_a_missing_one():
    from moebench.results.gate import _latency_rules

    def point(ci):
        return {"vs_baseline": {"p99_ttft_ratio": {"median": sum(ci) / 2, "ci95": ci, "trials": [1.0, 1.0]}}}
    summary = {"serving": {"loads": [{"label": "4/s"}, {"label": "8/s"}, {"label": "16/s"}, {"label": "inf"}],
                           "configs": {"c": {"4/s": point([0.8, 1.05]), "8/s": point([1.2, 1.4]),
                                             "16/s": point([0.9, 1.3])}}}}
    rules = {r.name.rsplit("@ ", 1)[1]: r.status for r in _latency_rules(summary, "c", 0.1)}
    assert rules == {"4/s": "pass", "8/s": "FAIL", "16/s": "inconclusive", "inf": "inconclusive"}
