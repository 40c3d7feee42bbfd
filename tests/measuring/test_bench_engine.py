"""`moebench bench-engine`: the arithmetic of its figures, one-line refusals of bad input, and whole
runs on a tiny checkpoint against transformers and against llama.cpp's real llama-server (built by
moebench; skipped loudly where it cannot be built, a failure in CI), checking the written manifest:
decode rates for both engines, bytes per step, the bandwidth measured in the run, the roofline, and
greedy agreement with transformers."""

from __future__ import annotations

import json
import math
import statistics
import sys

import pytest

from moebench.measuring.bench_engine import (decode_rate, first_difference, identical_count, round_interval,
                                             step_timed_disagreements, step_timed_rate)
from moebench.cli.app import main
from benchmark_scripts import load_benchmark
from tiny_models import make_tiny_checkpoint, write_char_tokenizer


def run_cli(capsys, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["moebench", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_char_tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "tiny"), 211)


def test_decode_rate_subtracts_the_one_token_run():
    # 4 sequences, 9 tokens each: 4 * 8 decode tokens in 2.0 - 0.4 s
    assert decode_rate(4, 9, 0.4, 2.0) == pytest.approx(32 / 1.6)
    assert math.isnan(decode_rate(4, 9, 0.5, 0.5))  # noise larger than the decode: no figure


def test_step_timed_rate_counts_decode_steps_only_and_flags_rounds_far_off_it():
    steps = [{"phase": "prefill", "duration_s": 5.0, "decode_tokens": 0},
             {"phase": "decode", "duration_s": 0.5, "decode_tokens": 4},
             {"phase": "decode", "duration_s": 1.5, "decode_tokens": 4}]
    assert step_timed_rate(steps) == pytest.approx(8 / 2.0)
    assert math.isnan(step_timed_rate(steps[:1]))
    row = {"threads": 1, "batch": 4, "engines": {
        "moebench": {"decode_tok_s_rounds": [100.0, 140.0, float("nan")],
                     "decode_tok_s_step_timed_rounds": [105.0, 100.0, 100.0]},
        "llama-batched-bench": {"decode_tok_s_rounds": [50.0]}}}
    assert step_timed_disagreements([row]) == [
        "moebench, 1 thread(s), batch 4, round 2: 140.0 tok/s by subtraction against 100.0 by its own step times"]


def test_greedy_comparison_counts_and_locates_differences():
    reference = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got = [[1, 2, 3], [4, 0, 6], [7, 8]]
    assert identical_count(got, reference) == 1
    assert first_difference(got, reference) == [None, 1, 2]


@pytest.mark.parametrize("args, needle", [
    (["--vs", "vllm"], "--vs"),
    (["--new-tokens", "1"], "--new-tokens"),
    (["--threads", "0"], "--threads"),
    (["--kernel", "fast"], "--kernel"),
    (["--vs", "llama.cpp", "--llama-bench", "fastest"], "--llama-bench"),
    (["--llama-bench", "batched"], "with --vs llama.cpp"),  # a yardstick of llama.cpp, not of transformers
])
def test_bad_options_are_one_line_exit_2(capsys, monkeypatch, tiny, args, needle):
    code, _, err = run_cli(capsys, monkeypatch, "bench-engine", "--model", tiny, *args)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_missing_model_is_one_line_exit_2(capsys, monkeypatch, tmp_path):
    code, _, err = run_cli(capsys, monkeypatch, "bench-engine", "--model", tmp_path / "nothing")
    assert code == 2 and "config.json" in err and "Traceback" not in err


def _check_manifest(path, other: str, batches, threads, engines=None):
    manifest = json.loads(path.read_text())
    assert manifest["schema"] == "moebench.bench-engine/1" and manifest["vs"] == other
    assert manifest["versions"]["torch"] and "git_commit" in manifest  # what ran (None outside a git checkout)
    assert sorted((r["threads"], r["batch"]) for r in manifest["rows"]) == sorted(
        (t, b) for t in threads for b in batches)
    for row in manifest["rows"]:
        assert row["bytes_per_step"] > 0 and row["bandwidth_gb_s"] > 0
        assert row["roofline_tok_s"] == pytest.approx(row["batch"] * row["bandwidth_gb_s"] * 1e9 / row["bytes_per_step"])
        assert set(row["engines"]) == {"moebench", *(engines or [other])}
        # a probe before each round's first run, and one after each engine's run: 3 (4 with two
        # llama.cpp yardsticks) per round and batch
        assert len(row["bandwidth_by_reader_probes"]) == (len(row["engines"]) + 1) * manifest["repeats"] * len(batches)
        assert row["best_bandwidth_gb_s"] == max(max(p.values()) for p in row["bandwidth_by_reader_probes"])
        for name, figures in row["engines"].items():
            assert len(figures["decode_tok_s_rounds"]) == manifest["repeats"]
            if name.startswith("moebench"):  # the runtime's own clock beside the subtraction
                assert len(figures["decode_tok_s_step_timed_rounds"]) == manifest["repeats"]
                assert all(r > 0 for r in figures["decode_tok_s_step_timed_rounds"])
            else:
                assert "decode_tok_s_step_timed_rounds" not in figures
            # each run against the bandwidth of its own minute (and its own bytes), and the median of those
            paired = [rate * figures["bytes_per_step"] / (row["batch"] * gb_s * 1e9)
                      for rate, gb_s in zip(figures["decode_tok_s_rounds"], figures["bandwidth_gb_s_rounds"], strict=True)]
            assert figures["roofline_fraction_rounds"] == pytest.approx(paired, nan_ok=True)  # NaN: no decode time
            # the median of the rounds that measured (a round whose subtraction failed is nan)
            measured = [f for f in paired if math.isfinite(f)]
            assert figures["roofline_fraction"] == pytest.approx(
                statistics.median(measured) if measured else math.nan, nan_ok=True)
            _check_interval(figures["roofline_fraction_interval"], figures["roofline_fraction_rounds"])
            assert max(figures["bandwidth_gb_s_rounds"]) <= row["best_bandwidth_gb_s"]
            # A random tiny model's logits can nearly tie, so a long greedy path may split on float
            # reordering; the runtime's first tokens must agree with transformers', llama.cpp's
            # (other kernels, batched slots) its first one.
            agree = 2 if name == "moebench" else 1
            if name == "llama-batched-bench":  # it decodes random tokens: nothing to compare
                assert figures["first_difference"] is figures["greedy_identical_to_transformers"] is None
                continue
            assert all(d is None or d >= agree for d in figures["first_difference"]), (name, figures)
        _check_interval(row["ratio_interval"], row["ratio_rounds"])
    assert manifest["runtime_evidence"]["kernel"]["fused_calls"] > 0
    return manifest


def _check_interval(interval, rounds):
    """The geometric mean of the usable rounds and its t interval; none from fewer than two."""
    usable = [v for v in rounds if math.isfinite(v) and v > 0]
    if len(usable) < 2:
        assert interval == {"geomean": None, "ci95": None}
        return
    assert interval["geomean"] == pytest.approx(math.exp(statistics.fmean(map(math.log, usable))))
    low, high = interval["ci95"]
    assert low <= interval["geomean"] <= high


def test_round_interval_is_a_t_interval_on_the_logs():
    centre = round_interval([0.8, 0.9, 1.0])
    assert centre["geomean"] == pytest.approx((0.8 * 0.9 * 1.0) ** (1 / 3))
    logs = [math.log(v) for v in (0.8, 0.9, 1.0)]
    half = 4.302652729911275 * statistics.stdev(logs) / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    assert centre["ci95"] == pytest.approx([math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half)])
    assert round_interval([0.8, float("nan")]) == {"geomean": None, "ci95": None}


def _manifest(prompt_len, ratios, fractions):
    row = {"threads": 2, "batch": 1, "ratio_rounds": ratios, "engines": {
        "moebench": {"roofline_fraction_rounds": fractions, "roofline_fraction": statistics.median(fractions)},
        "llama.cpp": {"roofline_fraction_rounds": [f / r for f, r in zip(fractions, ratios)],
                      "roofline_fraction": statistics.median(f / r for f, r in zip(fractions, ratios))}}}
    return {"vs": "llama.cpp", "params": 10, "prompt_len": prompt_len, "new_tokens": 64, "kernel": "fused",
            "scheduler": "static", "rows": [row]}


def test_pooled_runs_are_every_round_of_every_run(tmp_path, capsys):
    pool = load_benchmark("pool_bench_engine")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_manifest(128, [1.2, 1.4, 1.3], [0.7, 0.9, 0.8])))
    b.write_text(json.dumps(_manifest(128, [1.1, 1.5], [0.6, 1.0])))
    (cell,) = pool.pool(pool.load_runs([a, b]))
    assert (cell["runs"], cell["rounds"]) == (2, 5)
    assert cell["ratio_median"] == pytest.approx(1.3)
    mine = cell["engines"]["moebench"]
    assert mine["roofline_fraction"] == pytest.approx(0.8) and mine["run_medians"] == [0.8, 0.8]
    assert mine["roofline_fraction_interval"] == round_interval([0.7, 0.9, 0.8, 0.6, 1.0])
    assert pool.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "2 bench-engine runs pooled" in out and "warning: these runs are not all of one recorded commit" in out
    other = tmp_path / "c.json"
    other.write_text(json.dumps(_manifest(64, [1.0, 1.0], [0.5, 0.5])))
    assert pool.main([str(a), str(other)]) == 2
    err = capsys.readouterr().err
    assert "differ in prompt_len" in err and len(err.strip().splitlines()) == 1


def test_against_transformers_writes_the_figures(capsys, monkeypatch, tiny, tmp_path):
    out = tmp_path / "bench.json"
    code, stdout, err = run_cli(capsys, monkeypatch, "bench-engine", "--model", tiny, "--batch", "1", "--batch", "3",
                                "--threads", "1", "--new-tokens", "5", "--repeats", "2", "--prompt-len", "12",
                                "--out", out)
    assert code in (0, None), err
    assert "roofline" in stdout
    assert "geometric mean [low, high]" in " ".join(stdout.split())  # the intervals' legend, not eaten as markup
    manifest = _check_manifest(out, "transformers", [1, 3], [1])
    assert manifest["threads_reason"] == "given"


def test_against_llama_cpp_server(capsys, monkeypatch, tiny, tmp_path, llama_server):
    out = tmp_path / "bench.json"
    code, stdout, err = run_cli(capsys, monkeypatch, "bench-engine", "--model", tiny, "--vs", "llama.cpp",
                                "--batch", "1", "--batch", "2", "--threads", "1", "--new-tokens", "6",
                                "--repeats", "1", "--prompt-len", "10", "--out", out)
    assert code in (0, None), err
    assert "llama-server in huge pages" in stdout and "llama-batched-bench in huge pages" in stdout
    yardsticks = ["llama-server", "llama-batched-bench"]  # both by default
    manifest = _check_manifest(out, "llama.cpp", [1, 2], [1], yardsticks)
    assert manifest["llama_bench"] == "both"
    for argv in (manifest["llama_server"]["argv"], manifest["llama_batched_bench"]["argv"]["1"]["2"]):
        assert "--load-mode" in argv and argv[argv.index("--load-mode") + 1] == "none"
        assert argv[argv.index("-ctk") + 1] == "f32"
    # batched-bench ran each cell with the same prompt, the decode steps of 6 new tokens, the batch
    assert sorted((r["prompt_tokens"], r["decode_steps"], r["batch"]) for r in manifest["llama_batched_bench"]["runs"]) == [
        (10, 5, 1), (10, 5, 2)]
    for row in manifest["rows"]:
        rates = {name: row["engines"][name]["decode_tok_s"] for name in yardsticks}  # NaN: no decode time
        rates = {name: rate if math.isfinite(rate) else -math.inf for name, rate in rates.items()}
        assert row["ratio_against"] == max(rates, key=rates.get)  # the faster llama.cpp figure
        assert row["ratio_rounds"] == row["ratios"][row["ratio_against"]]["rounds"]
        for name in yardsticks:
            assert row["ratios"][name]["rounds"] == pytest.approx(
                [m / o for m, o in zip(row["engines"]["moebench"]["decode_tok_s_rounds"],
                                       row["engines"][name]["decode_tok_s_rounds"])], nan_ok=True)


def test_llama_bench_server_alone(capsys, monkeypatch, tiny, tmp_path, llama_server):
    out = tmp_path / "bench.json"
    code, stdout, err = run_cli(capsys, monkeypatch, "bench-engine", "--model", tiny, "--vs", "llama.cpp",
                                "--llama-bench", "server", "--batch", "1", "--threads", "1", "--new-tokens", "4",
                                "--repeats", "1", "--prompt-len", "6", "--out", out)
    assert code in (0, None), err
    manifest = _check_manifest(out, "llama.cpp", [1], [1], ["llama-server"])
    assert manifest["llama_batched_bench"] is None and manifest["rows"][0]["ratio_against"] == "llama-server"
