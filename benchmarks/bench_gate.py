"""Measured false-alarm rate and power of `moebench gate` on this machine.

    python benchmarks/bench_gate.py --runs 20 --max-load 2.5 --out results/bench-gate.json

Defaults (measured to meet <= 1/20 false alarms and >= 19/20 detections here): regression
rule with X = 0.05, 20 interleaved trials per config of one batch of 8 items, 48 new tokens,
one torch thread; ~17 minutes for the 40 runs on 2 cores at load 1-3.

Each run is a short, real `moebench run` of two configs with identical switches, "baseline"
and "candidate", measured interleaved (B C B C ...) by the same loop as `moebench run`
(`moebench.measuring.measure.measure`), summarized by `moebench.results.summary.build_summary` and judged by
`moebench.results.gate.evaluate` under one regression policy. Two scenarios alternate run by run, so
machine-load drift hits both alike:

  aa        the candidate is the baseline (A/A): every gate failure is a false alarm
  slowdown  the candidate's engine does `--slowdown` (default 15%) extra real compute per
            forward (`SlowedPrefetcher` below wraps its prefetch strategy, in an engine built on the
            bundled one and handed to measure() as its backend; the package has no test hook):
            every gate failure is a detection

The regression rule (`--rule`), with tolerance X (`--tolerance`):

  regression      fail when the speedup's 95% CI upper bound < 1 - X: the gate's own
                  `regression` rule against a committed speedup of 1.0 and max_slowdown = X
                  (a slowdown must be shown to fail)
  noninferiority  fail when the speedup's 95% CI lower bound < 1 - X: the gate's `speedup`
                  rule with min_speedup = 1 - X (a non-slowdown must be shown to pass)

Every gate rule counts (accuracy, identical outputs, activation too), as in CI. Per run the
speedup median and CI are kept, and both rules are also evaluated at several tolerances
(`threshold_sweep` in the JSON), so a choice can be checked against the same runs.

See docs/gate.md for the method and the measured figures.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from moebench.ablation import runtime_for
from moebench.backends.bundled import BundledBackend
from moebench.engine import Engine
from moebench.models.random import make_random_qwen3_moe

SCHEMA = "moebench.bench_gate/1"
SCENARIOS = ("aa", "slowdown")
RULES = ("regression", "noninferiority")
SWEEP_TOLERANCES = (0.03, 0.05, 0.065, 0.08, 0.10)
# The bundled model's shape (see FACTS.md): used for the random stand-in when it is absent.
RANDOM_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
                    intermediate_size=512, vocab_size=211)

console = Console(stderr=True)


# ---------------------------------------------------------------- model and suite

def make_random_model(directory: Path, seed: int = 0) -> Path:
    """A random qwen3_moe of the bundled model's shape, plus a character tokenizer."""
    return make_random_qwen3_moe(directory, RANDOM_SHAPE, seed=seed, char_tokenizer=True, initializer_range=0.15)


def _default_gsm8k_dir() -> Path | None:
    env = os.environ.get("MOEBENCH_GSM8K_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k")
    return next((p for p in candidates if (p / "test.jsonl").is_file()), None)


def resolve_model_and_suite(model: Path | None, suite: str | None, data: Path | None,
                            workdir: Path) -> tuple[Path, str, Path | None, str]:
    """(model path, suite name, data dir, description): the bundled model with gsm-synth when
    it is present, else a random qwen3_moe with GSM8K from the local copy."""
    from moebench.measuring.run import bundled_model_path

    if model is None:
        bundled = bundled_model_path()
        if (bundled / "config.json").is_file():
            return bundled, suite or "gsm-synth", data, "bundled gsm-synth-moe"
        model = make_random_model(workdir / "random-qwen3-moe")
        desc = "random qwen3_moe (bundled shape: 4 layers, hidden 256, 16 experts top-2)"
    else:
        desc = str(model)
    suite = suite or "gsm8k"
    if suite.startswith("gsm8k") and data is None:
        data = _default_gsm8k_dir()
    return model, suite, data, desc


# ---------------------------------------------------------------- one run

def _configs():
    from moebench.ablation import OFF, ConfigPoint

    return [ConfigPoint("baseline", OFF["kernel"], OFF["scheduler"], OFF["prefetch"]),
            ConfigPoint("candidate", OFF["kernel"], OFF["scheduler"], OFF["prefetch"])]


def _burn(seconds: float) -> None:
    """Real extra work (matrix products, not a sleep), so the slowdown competes for the core."""
    import torch

    x = torch.ones(64, 64)
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        x = torch.tanh(x @ x * 1e-3)


class SlowedPrefetcher:
    """The candidate's prefetch strategy, wrapped: after the last MoE layer of every forward it does
    `slowdown` x (the forward's time so far) of extra compute. It lives here, not in the engine: the
    product's step has no test hook. Everything else (evidence, activation) is the wrapped one's."""

    active = True  # its hooks do something even where the wrapped strategy's (prefetch=off's) do not

    def __init__(self, inner, slowdown: float, last_moe_layer: int):
        self.inner, self.slowdown, self.last = inner, slowdown, last_moe_layer
        self._forward_start: float | None = None

    def before_forward(self, h) -> None:
        self._forward_start = time.perf_counter()
        self.inner.before_forward(h)

    def before_layer(self, layer: int, x) -> None:
        self.inner.before_layer(layer, x)

    def after_layer(self, layer: int, h) -> None:
        self.inner.after_layer(layer, h)
        if layer == self.last and self._forward_start is not None:
            _burn(self.slowdown * (time.perf_counter() - self._forward_start))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SlowedEngine(Engine):
    """The candidate's engine: the bundled engine whose sessions run the prefetch strategy wrapped in
    a SlowedPrefetcher, composed through Engine.store_and_prefetcher like any engine built on it."""

    def __init__(self, ckpt, tokenizer, runtime, slowdown: float):
        super().__init__(ckpt, tokenizer, runtime)
        self.slowdown = slowdown

    def store_and_prefetcher(self):
        store, prefetcher = super().store_and_prefetcher()
        cfg = self.ckpt.config
        last = max(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
        return store, SlowedPrefetcher(prefetcher, self.slowdown, last)


class SlowedBackend(BundledBackend):
    """The bundled backend, handed to measure() as any backend is; with a slowdown, the config named
    "candidate" runs a SlowedEngine and every other config the plain one."""

    def __init__(self, configs, checkpoints, tokenizer, base_runtime, slowdown: float = 0.0):
        from moebench.measuring.measure import warm_up

        super().__init__(configs, checkpoints, tokenizer, base_runtime, warm_up=warm_up)
        self.slowdown = slowdown

    @contextlib.contextmanager
    def session(self, cfg, label: str = ""):
        if cfg.name == "candidate" and self.slowdown:
            yield SlowedEngine(self.checkpoints(cfg), self.tokenizer, runtime_for(self.base_runtime, cfg),
                               self.slowdown)
        else:
            with super().session(cfg, label) as engine:
                yield engine


@contextlib.contextmanager
def _quiet(quiet: bool):
    """measure() reports progress and its summary on the terminal; the benchmark keeps its own."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def _manifest(run_dir: Path, ckpt, suite_obj, configs, runtime, repeats: int, machine: dict,
              scenario: str, slowdown: float) -> dict:
    from moebench.measuring.machine import git_commit, package_versions
    from moebench.measuring.run import _model_summary

    return {
        "schema": "moebench.manifest/1",
        "run_id": run_dir.name,
        "command": "benchmarks/bench_gate.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "args": {"bench_gate": True, "scenario": scenario, "inject_slowdown": slowdown, "warmup": 0,
                 "repeats": repeats},
        "model": _model_summary(ckpt),
        "suite": suite_obj.describe(),
        "configs": [c.to_dict() for c in configs],
        "baseline": configs[0].name,
        "runtime": {"device": runtime.device, "dtype": str(runtime.torch_dtype).replace("torch.", ""),
                    "batch_size": runtime.batch_size, "max_new_tokens": runtime.max_new_tokens,
                    "expert_budget": runtime.expert_budget, "offload_tier": runtime.offload_tier,
                    "admission": runtime.admission, "kv_block_size": runtime.kv_block_size},
        "repeats": repeats,
        "warmup_items": 0,
        "seed": 0,
        "git_commit": git_commit(),
        "versions": package_versions(),
        "machine": machine,
    }


def measure_once(run_dir: Path, ckpt, tokenizer, suite_obj, runtime, repeats: int, machine: dict,
                 scenario: str, slowdown: float, quiet: bool = True) -> dict:
    """One interleaved baseline/candidate run into run_dir; returns its summary.

    measure() ends by writing summary.json with moebench.results.summary.build_summary; the gate reads
    it back the way `moebench gate RUN_DIR` does (load_summary).
    """
    from moebench.fileio import atomic_write_json
    from moebench.measuring.args import RunArgs
    from moebench.measuring.measure import CheckpointVariants, measure
    from moebench.results.summary import load_summary

    configs = _configs()
    manifest = _manifest(run_dir, ckpt, suite_obj, configs, runtime, repeats, machine, scenario,
                         slowdown if scenario == "slowdown" else 0.0)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "manifest.json", manifest)
    backend = SlowedBackend(configs, CheckpointVariants(ckpt), tokenizer, runtime,
                            slowdown if scenario == "slowdown" else 0.0)
    with _quiet(quiet):
        measure(run_dir, manifest, configs, ckpt, tokenizer, suite_obj, runtime, RunArgs(warmup=0),
                backend=backend)
    return load_summary(run_dir)


# ---------------------------------------------------------------- gate rules

def rule_policy(rule: str, tolerance: float):
    """(Policy, committed summary or None) that make moebench.results.gate.evaluate apply `rule`, to the
    decode speedup (the one this benchmark was calibrated on, docs/gate.md)."""
    from moebench.results.policy import Policy

    if rule == "regression":
        # Against a committed speedup of 1.0 (the baseline itself): the current speedup's CI
        # upper bound must reach 1 - tolerance. min_speedup 0 leaves the speedup rule inert
        # (it still requires an interval to exist).
        committed = {"schema": "moebench.summary/1", "baseline": "baseline",
                     "configs": [{"name": "baseline"},
                                 {"name": "candidate", "vs_baseline": {"speedup": {"median": 1.0}}}]}
        return Policy(config="candidate", metric="decode", min_speedup=0.0, max_slowdown=tolerance), committed
    if rule == "noninferiority":
        return Policy(config="candidate", metric="decode", min_speedup=1.0 - tolerance), None
    raise ValueError(f"unknown rule {rule!r} (choose from {RULES})")


def judge(summary: dict, rule: str, tolerance: float) -> tuple[bool, list[dict]]:
    """The whole gate's verdict (every rule, as moebench gate gives it) and its rules."""
    from moebench.results.gate import evaluate

    policy, committed = rule_policy(rule, tolerance)
    rules = evaluate(summary, policy, committed, committed_source="bench_gate: speedup 1.0")
    return all(r.passed for r in rules), [
        {"name": r.name, "measured": r.measured, "threshold": r.threshold, "passed": r.passed} for r in rules]


def _speedup(summary: dict) -> dict:
    from moebench.results.summary import config_entry

    return config_entry(summary, "candidate")["vs_baseline"]["speedup"]


# ---------------------------------------------------------------- aggregation

def _dist(values: list[float]) -> dict | None:
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if x.size == 0:
        return None
    return {"min": float(x.min()), "p5": float(np.percentile(x, 5)), "median": float(np.median(x)),
            "p95": float(np.percentile(x, 95)), "max": float(x.max()), "mean": float(x.mean()),
            "sd": float(x.std(ddof=1)) if x.size > 1 else 0.0}


def _scenario_block(runs: list[dict]) -> dict:
    n = len(runs)
    fails = sum(not r["gate_passed"] for r in runs)
    sp = [r["speedup"] for r in runs]
    ci = [s.get("ci95") or [None, None] for s in sp]
    return {
        "runs": n,
        "gate_failures": fails,
        "rate": fails / n if n else None,
        "speedup_median": _dist([s.get("median") for s in sp]),
        "ci_lower": _dist([c[0] for c in ci]),
        "ci_upper": _dist([c[1] for c in ci]),
        "ci_width": _dist([c[1] - c[0] if None not in c else None for c in ci]),
        "ci_methods": sorted({str(s.get("ci_method")) for s in sp}),
        "trial_ratios_sd": _dist([r.get("trial_ratio_sd") for r in runs]),
    }


def _sweep(runs: list[dict], summaries: list[dict]) -> list[dict]:
    out = []
    for rule in RULES:
        for tol in SWEEP_TOLERANCES:
            row = {"rule": rule, "tolerance": tol}
            for scen in SCENARIOS:
                verdicts = [judge(s, rule, tol)[0] for r, s in zip(runs, summaries) if r["scenario"] == scen]
                row[scen] = {"runs": len(verdicts), "gate_failures": sum(not v for v in verdicts)}
            out.append(row)
    return out


def _trial_ratios(summary: dict) -> list[float]:
    from moebench.results.summary import config_entry

    b = config_entry(summary, "baseline")["decode_tokens_per_s"]["trials"]
    c = config_entry(summary, "candidate")["decode_tokens_per_s"]["trials"]
    return [ci / bi for ci, bi in zip(c, b) if bi]


def _wait_for_load(max_load: float, max_wait_s: float, progress: bool) -> float:
    """Sleep until the 1-minute load average is below max_load (or max_wait_s passed)."""
    start = time.perf_counter()
    told = False
    while (load := _loadavg()) and load[0] >= max_load and time.perf_counter() - start < max_wait_s:
        if progress and not told:
            console.print(f"waiting for the load average ({load[0]}) to fall below {max_load}")
            told = True
        time.sleep(5)
    return time.perf_counter() - start


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---------------------------------------------------------------- the benchmark

def run_bench(runs: int = 20, scenarios: tuple[str, ...] = SCENARIOS, model: Path | None = None,
              suite: str | None = None, data: Path | None = None, items: int = 8, num_fewshot: int = 0,
              repeats: int = 20, batch_size: int = 8, max_new_tokens: int = 48, slowdown: float = 0.15,
              rule: str = "regression", tolerance: float = 0.05, workdir: Path | None = None,
              keep: bool = False, quiet: bool = True, progress: bool = True, threads: int | None = 1,
              max_load: float | None = None, max_wait_s: float = 1800.0) -> dict:
    """Run the benchmark and return its result (the JSON written by --out).

    threads: torch threads while measuring (restored after); None leaves torch's setting.
    max_load: before each A/A + slowdown pair, wait until the 1-minute load average is below
    this, so the figures describe a machine that quiet; max_wait_s bounds all waits together.
    """
    import torch

    from moebench.engine import RuntimeConfig
    from moebench.measuring.machine import describe_machine
    from moebench.measuring.measure import CheckpointVariants, warm_up
    from moebench.measuring.run import _load_model
    from moebench.suites import load_suite

    for s in scenarios:
        if s not in SCENARIOS:
            raise ValueError(f"unknown scenario {s!r} (choose from {SCENARIOS})")
    rule_policy(rule, tolerance)  # fail early on a bad rule
    started = time.perf_counter()
    load_start = _loadavg()
    with contextlib.ExitStack() as stack:
        if threads:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            stack.callback(torch.set_num_threads, previous)
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gate-")))
            keep = False
        workdir.mkdir(parents=True, exist_ok=True)
        model_path, suite_name, data_dir, model_desc = resolve_model_and_suite(model, suite, data, workdir)
        runtime = RuntimeConfig(batch_size=batch_size, max_new_tokens=max_new_tokens)
        suite_obj = load_suite(suite_name, data_dir, items, num_fewshot=num_fewshot)
        ckpt, tokenizer = _load_model(model_path, runtime)
        machine = describe_machine(measure_bandwidth=False)
        # One warm-up for the whole benchmark (the process stays warm between runs).
        with _quiet(quiet):
            warm_up(_configs(), CheckpointVariants(ckpt), tokenizer, suite_obj, runtime, runtime_for,
                    min(len(suite_obj.items), 4))

        results, summaries = [], []
        order = [(i, s) for i in range(runs) for s in scenarios]
        waited = 0.0
        for k, (i, scen) in enumerate(order):
            if max_load is not None and scen == scenarios[0]:
                waited += _wait_for_load(max_load, max(0.0, max_wait_s - waited), progress)
            run_dir = workdir / f"{scen}-{i:03d}"
            t0 = time.perf_counter()
            summary = measure_once(run_dir, ckpt, tokenizer, suite_obj, runtime, repeats, machine, scen,
                                   slowdown, quiet=quiet)
            passed, rules = judge(summary, rule, tolerance)
            sp = _speedup(summary)
            ratios = _trial_ratios(summary)
            rec = {
                "scenario": scen, "index": i, "run_dir": str(run_dir) if keep else None,
                "speedup": {"median": sp.get("median"), "ci95": sp.get("ci95"), "ci_method": sp.get("ci_method")},
                "trial_ratios": ratios,
                "trial_ratio_sd": float(np.std(ratios, ddof=1)) if len(ratios) > 1 else None,
                "baseline_decode_tokens_per_s": summary["configs"][0]["decode_tokens_per_s"]["median"],
                "gate_passed": passed,
                "failed_rules": [r["name"] for r in rules if not r["passed"]],
                "rules": rules,
                "wall_s": round(time.perf_counter() - t0, 2),
                "loadavg": _loadavg(),
            }
            results.append(rec)
            summaries.append(summary)
            if progress:
                ci = sp.get("ci95") or [math.nan, math.nan]
                console.print(f"[{k + 1}/{len(order)}] {scen:>8} #{i}: speedup {sp.get('median') or math.nan:.3f} "
                              f"[{ci[0]:.3f}, {ci[1]:.3f}] gate {'pass' if passed else 'FAIL'} "
                              f"({rec['wall_s']:.1f} s, load {rec['loadavg'][0] if rec['loadavg'] else '?'})")

        out = {
            "schema": SCHEMA,
            "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python benchmarks/bench_gate.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "settings": {"runs": runs, "scenarios": list(scenarios), "model": model_desc,
                         "torch_threads": torch.get_num_threads(), "max_load": max_load,
                         "model_path": str(model_path) if model is not None or keep else None,
                         "suite": suite_name, "items": len(suite_obj.items), "num_fewshot": num_fewshot,
                         "repeats": repeats, "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                         "slowdown": slowdown, "expected_slowdown_speedup": 1 / (1 + slowdown)},
            "rule": {"kind": rule, "tolerance": tolerance, "description": _describe_rule(rule, tolerance)},
            "machine": {**machine, "loadavg_start": load_start, "loadavg_end": _loadavg()},
            "wall_s": round(time.perf_counter() - started, 1),
            "waited_for_load_s": round(waited, 1),
            "scenarios": {s: _scenario_block([r for r in results if r["scenario"] == s]) for s in scenarios},
            "threshold_sweep": _sweep(results, summaries),
            "runs": results,
        }
        out["targets"] = _targets(out)
        return out


def _describe_rule(rule: str, tolerance: float) -> str:
    if rule == "regression":
        return (f"fail when the candidate's speedup 95% CI upper bound < {1 - tolerance:.3f} "
                f"(gate regression rule, committed speedup 1.0, max_slowdown {tolerance:g})")
    return (f"fail when the candidate's speedup 95% CI lower bound < {1 - tolerance:.3f} "
            f"(gate speedup rule, min_speedup {1 - tolerance:g})")


def _targets(out: dict) -> dict:
    """False alarms <= 1 in 20 and detections >= 19 in 20, scaled to the number of runs."""
    sc = out["scenarios"]
    t = {}
    if "aa" in sc:
        n = sc["aa"]["runs"]
        t["max_false_alarms"] = math.floor(n / 20)
        t["false_alarms_ok"] = sc["aa"]["gate_failures"] <= t["max_false_alarms"]
    if "slowdown" in sc:
        n = sc["slowdown"]["runs"]
        t["min_detections"] = math.ceil(n * 19 / 20)
        t["detections_ok"] = sc["slowdown"]["gate_failures"] >= t["min_detections"]
    t["met"] = all(v for k, v in t.items() if k.endswith("_ok"))
    return t


def results_table(out: dict) -> Table:
    table = Table(title=f"moebench gate: {out['rule']['description']}")
    for col in ("scenario", "runs", "gate failures", "rate", "speedup: min", "median", "max",
                "CI lower p50", "CI upper p50", "CI width p50"):
        table.add_column(col, no_wrap=True)
    for scen, b in out["scenarios"].items():
        m, lo, hi, w = b["speedup_median"], b["ci_lower"], b["ci_upper"], b["ci_width"]

        def f(d, k="median"):
            return f"{d[k]:.3f}" if d else "-"
        table.add_row(
            "A/A" if scen == "aa" else f"slowdown {out['settings']['slowdown']:.0%}",
            str(b["runs"]), str(b["gate_failures"]), f"{b['rate']:.0%}" if b["rate"] is not None else "-",
            f(m, "min"), f(m), f(m, "max"), f(lo), f(hi), f(w))
    return table


def sweep_table(out: dict) -> Table:
    table = Table(title="same runs, other rules (gate failures / runs)")
    for col in ("rule", "tolerance", "fails when", *(("A/A",) if "aa" in out["scenarios"] else ()),
                *(("slowdown",) if "slowdown" in out["scenarios"] else ())):
        table.add_column(col)
    for row in out["threshold_sweep"]:
        bound = "CI upper" if row["rule"] == "regression" else "CI lower"
        cells = [f"{row[s]['gate_failures']}/{row[s]['runs']}" for s in SCENARIOS if s in out["scenarios"]]
        table.add_row(row["rule"], f"{row['tolerance']:g}", f"{bound} < {1 - row['tolerance']:.3f}", *cells)
    return table


def bench_gate_command(
    runs: int = typer.Option(20, "--runs", help="Runs per scenario (A/A and slowdown alternate)."),
    scenario: list[str] = typer.Option(list(SCENARIOS), "--scenario", help="aa and/or slowdown (repeat the option)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory. Default: the bundled model with gsm-synth, else a random qwen3_moe of the bundled shape with GSM8K."),
    suite: Optional[str] = typer.Option(None, "--suite", help="Suite (default gsm-synth with the bundled model, else gsm8k)."),
    data: Optional[Path] = typer.Option(None, "--data", help="GSM8K directory (default $MOEBENCH_GSM8K_DIR, else ../shared/data/gsm8k)."),
    items: int = typer.Option(8, "--items", help="Suite items per trial."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="Few-shot examples per prompt."),
    repeats: int = typer.Option(20, "--repeats", help="Interleaved trials per config in each run."),
    batch_size: int = typer.Option(8, "--batch-size"),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
    slowdown: float = typer.Option(0.15, "--slowdown", help="Extra compute per engine step in the slowdown scenario's candidate."),
    rule: str = typer.Option("regression", "--rule", help="regression (fail when CI upper < 1 - tolerance) or noninferiority (fail when CI lower < 1 - tolerance)."),
    tolerance: float = typer.Option(0.05, "--tolerance", help="X in 1 - X."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the results as JSON here."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Keep the run directories here (default: a temporary directory, removed)."),
    threads: int = typer.Option(1, "--threads", help="torch threads. 1 by default: on a shared, oversubscribed CPU, OpenMP's multi-thread barriers made steps ~40x slower and far noisier."),
    max_load: Optional[float] = typer.Option(None, "--max-load", help="Before each A/A + slowdown pair, wait until the 1-minute load average is below this (30 minutes of waiting at most, in all)."),
    verbose: bool = typer.Option(False, "--verbose", help="Show measure()'s progress and tables."),
) -> None:
    """Measure how often the gate fails on A/A runs (false alarms) and on an injected slowdown (power)."""
    from moebench.fileio import atomic_write_json

    result = run_bench(runs=runs, scenarios=tuple(scenario), model=model, suite=suite, data=data, items=items,
                       num_fewshot=num_fewshot, repeats=repeats, batch_size=batch_size,
                       max_new_tokens=max_new_tokens, slowdown=slowdown, rule=rule, tolerance=tolerance,
                       workdir=workdir, keep=workdir is not None, quiet=not verbose, threads=threads,
                       max_load=max_load)
    out_console = Console()
    if not out_console.is_terminal:
        out_console.width = max(out_console.width, 130)
    out_console.print(results_table(result))
    out_console.print(sweep_table(result))
    t = result["targets"]
    out_console.print(f"load average start {result['machine']['loadavg_start']}, end {result['machine']['loadavg_end']}; "
                      f"wall {result['wall_s']:.0f} s; targets (false alarms <= 1/20, detections >= 19/20): "
                      f"{'met' if t['met'] else 'NOT met'}")
    if out:
        atomic_write_json(out, result)
        out_console.print(f"results: {out}")


def main() -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(bench_gate_command)
    from moebench.errors import MoebenchError

    try:
        app()
    except MoebenchError as e:
        print(f"bench_gate: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
