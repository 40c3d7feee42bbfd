"""The measurement loop of a run: warm-up with activation checks, interleaved trials, samples
appended as they complete, steps and the summary rewritten atomically after every trial."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moebench.errors import ActivationError
from moebench.fileio import BackgroundAppender, append_jsonl, atomic_write_bytes, atomic_write_json, atomic_write_text, read_jsonl

console = Console(stderr=True)


def _requests(suite, items, max_new_tokens, sampling=None, trial: int = 0):
    """The suite's requests. Under sampling (`sampling`: the run's settings, its seed the run seed)
    each gets its own seed from (run seed, trial, item id): paired across configurations, new per trial."""
    from moebench.engine import Request

    stop = tuple(suite.stop)
    if sampling is None or sampling.greedy:
        return [Request(item.id, suite.prompt(item), max_new_tokens, stop) for item in items]
    from dataclasses import replace

    from moebench.engine.sampling import request_seed

    return [Request(item.id, suite.prompt(item), max_new_tokens, stop,
                    replace(sampling, seed=request_seed(sampling.seed, trial, item.id))) for item in items]


def run_sampling(args):
    """The run's sampling settings (`args`: RunArgs; seed: the run seed), or None for greedy decoding."""
    if not args.temperature:
        return None
    from moebench.engine.sampling import SamplingParams

    return SamplingParams(float(args.temperature), float(args.top_p or 1.0), args.top_k, int(args.seed or 0))


def _completed_trials(run_dir: Path) -> set[tuple]:
    from moebench.measuring.samples import trial_key

    f = run_dir / "trials.jsonl"
    return {trial_key(r) for r in read_jsonl(f)} if f.exists() else set()


def _drop_partial_samples(run_dir: Path, done: set[tuple]) -> None:
    """A trial's timing is only valid whole: samples of an unfinished trial are redone on resume."""
    from moebench.measuring.samples import trial_key

    f = run_dir / "samples.jsonl"
    if not f.exists():
        return
    kept = [r for r in read_jsonl(f) if trial_key(r) in done]
    atomic_write_text(f, "".join(json.dumps(r) + "\n" for r in kept))


def _write_steps(run_dir: Path, steps: list[dict]) -> None:
    import io

    import pandas as pd

    buf = io.BytesIO()
    pd.DataFrame(steps).to_parquet(buf, index=False)
    atomic_write_bytes(run_dir / "steps.parquet", buf.getvalue())


def _load_steps(run_dir: Path, done: set[tuple]) -> list[dict]:
    from moebench.measuring.samples import trial_key

    f = run_dir / "steps.parquet"
    if not f.exists():
        return []
    import pandas as pd

    rows = pd.read_parquet(f).to_dict("records")
    return [r for r in rows if trial_key(r) in done]


class CheckpointVariants:
    """The loaded checkpoint, plus RTN-quantized copies for negative-control configs (made once)."""

    def __init__(self, ckpt):
        self.base = ckpt
        self._quantized = {}

    def __call__(self, cfg):
        if getattr(cfg, "quantize", "none") == "none":  # (an approximate LM head is the runtime's, not a copy)
            return self.base
        if cfg.quantize not in self._quantized:
            from moebench.engine.quantize import quantize_experts

            self._quantized[cfg.quantize] = quantize_experts(self.base, cfg.quantize)
        return self._quantized[cfg.quantize]


def warm_up(configs, ckpt, tokenizer, suite, base_runtime, runtime_for, n_items: int, sampling=None) -> None:
    """Run a few items per config; a switched-on optimization that leaves no evidence stops the run."""
    from moebench.engine import Engine

    if n_items <= 0:
        return
    # enough requests that continuous batching must admit into a running batch
    items = suite.items[: max(n_items, min(len(suite.items), base_runtime.batch_size + 2))]
    # staggered limits make requests finish at different steps even on a model that never stops,
    # so a continuous scheduler has to admit into a running batch to pass the check
    longest = min(base_runtime.max_new_tokens, 64)
    requests = _requests(suite, items, longest, sampling, trial=-1)  # (trial -1: not a measured trial's seeds)
    for i, request in enumerate(requests):
        request.max_new_tokens = max(2, longest * (1 + i % 3) // 3)
    seen = {}  # config name -> its warm-up evidence, judged against the baseline's below
    for cfg in configs:
        runtime = runtime_for(base_runtime, cfg)
        with console.status(f"warm-up: {cfg.name}"):
            result = Engine(ckpt(cfg), tokenizer, runtime).generate(requests)
        seen[cfg.name] = result.evidence
        # Every run, however small: only continuous batching's mid-flight admission depends on
        # the workload, and the engine itself says when it had no chance (not an error).
        errors = result.activation_errors + sampling_errors(sampling, result.evidence)
        if errors:
            raise ActivationError(f"config '{cfg.name}': " + "; ".join(errors))
    from moebench.backends.discrimination import refuse_bundled_non_discriminating

    refuse_bundled_non_discriminating(configs, seen, len(requests), base_runtime.batch_size)


def sampling_errors(sampling, evidence) -> list[str]:
    """The run asked for sampling: the engine's evidence must show it drew (engine/sampling.py)."""
    if sampling is None:
        return []
    from moebench.engine.sampling import sampling_activation_errors

    return sampling_activation_errors(sampling, evidence)


def trial_order(configs, trial: int) -> list:
    """The configs in the order trial `trial` runs them: rotated by one place per trial, so that no
    config always runs first (or right after the same neighbour) and an order effect (a cold
    start, a load spike that one position keeps catching) averages out over the trials instead of
    biasing every ratio the same way (docs/statistics.md)."""
    k = trial % len(configs) if configs else 0
    return list(configs[k:]) + list(configs[:k])


def not_exercised(cfg, evidence: dict, num_requests: int, runtime) -> list[str]:
    """Switches this workload gave no chance to show evidence (continuous batching with no more
    requests than slots, or a batch of one): the summary says "not exercised", never "ok"."""
    if isinstance((evidence or {}).get("not_exercised"), list):  # a server's, said by its backend
        return list(evidence["not_exercised"])
    sched = (evidence or {}).get("scheduler")
    if runtime is None or not isinstance(sched, dict) or "admissions_mid_flight" not in sched:
        return []  # not the bundled runtime's evidence: its own backend decides
    from moebench.engine.scheduler import scheduler_not_exercised

    return scheduler_not_exercised(cfg.scheduler, sched, num_requests, runtime.batch_size)


class ServerDied(Exception):
    def __init__(self, config: str, trial: int, result):
        failed = result.failed_requests
        first = next((c.error for c in result.completions if c.error), "")
        super().__init__(f"the server of config '{config}' exited with code {result.server_exit} during trial {trial}: "
                         f"{failed} of {len(result.completions)} requests failed (first: {first}); "
                         f"its log: {result.evidence.get('log')}")


def _run_loads(manifest: dict, args) -> list:
    """The loads each trial runs, as the manifest recorded them (a resumed run keeps its own): [None]
    for the closed loop of a run without loads."""
    loads = args.loads()
    if not loads:
        return [None]
    recorded = [ld["label"] for ld in manifest.get("loads") or []]
    if recorded and recorded != [ld.label for ld in loads]:
        from moebench.errors import MoebenchError

        raise MoebenchError(f"the manifest's loads {recorded} are not this run's {[ld.label for ld in loads]}")
    return loads


def measure(run_dir: Path, manifest: dict, configs, ckpt, tokenizer, suite, base_runtime, args,
            backend=None) -> None:
    """Run every (trial, config) not yet done. `backend` is the engine (moebench.backends); the
    default is the bundled runtime on `ckpt` with `base_runtime`."""
    from moebench.measuring.samples import sample_record

    repeats = manifest["repeats"]
    if backend is None:
        from moebench.backends.bundled import BundledBackend

        backend = BundledBackend(configs, CheckpointVariants(ckpt), tokenizer, base_runtime, run_sampling(args),
                                 warm_up=warm_up)
    configs = backend.configs
    max_new_tokens = base_runtime.max_new_tokens if base_runtime is not None else args.max_new_tokens
    done = _completed_trials(run_dir)
    _drop_partial_samples(run_dir, done)
    steps = _load_steps(run_dir, done)
    loads = _run_loads(manifest, args)
    todo = [(t, load, c) for t in range(repeats) for load in loads for c in trial_order(configs, t)
            if (c.name, t, load.label if load else None) not in done]
    items_by_id = {item.id: item for item in suite.items}
    sampling = run_sampling(args)
    if done:
        console.print(f"resuming {run_dir}: {len(done)} trials done, {len(todo)} to go")
    if todo:
        try:
            backend.warm_up(suite, args.warmup)
        except BaseException:
            backend.close()
            raise

    samples_file = run_dir / "samples.jsonl"
    activation_failures: list[str] = []
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console,
    )
    try:
        with progress:
            overall = progress.add_task("all trials", total=len(todo) * len(suite.items), rate="")
            for trial, load, cfg in todo:
                requests = _requests(suite, suite.items, max_new_tokens, sampling, trial)
                arrivals = load.offsets(len(requests), args.seed) if load else None
                at = {"load": load.label} if load else {}  # the closed loop of a run without loads: no key
                where = f" @ {load.label}" if load else ""
                task = progress.add_task(f"{cfg.name} #{trial}{where}", total=len(requests), rate="")
                tokens = [0]

                # open loop: the disk's pauses must not delay the next send (an fsync can take 20 ms)
                writer = BackgroundAppender(samples_file) if arrivals is not None else None

                def on_complete(completion, cfg=cfg, trial=trial, task=task, at=at, writer=writer):
                    record = {**sample_record(cfg.name, trial, items_by_id[completion.id], suite, completion), **at}
                    if writer is not None:
                        record.update(scheduled_s=completion.scheduled_s, sent_s=completion.sent_s)
                        writer.append(record)
                    else:
                        append_jsonl(samples_file, record)
                    tokens[0] += record["output_tokens"]
                    rate = f"{tokens[0] / max(time.perf_counter() - started, 1e-9):.1f} tok/s"
                    progress.update(task, advance=1, rate=rate)
                    progress.update(overall, advance=1)

                with backend.session(cfg, f"t{trial}") as engine:
                    started = time.perf_counter()
                    try:
                        result = engine.generate(requests, on_complete=on_complete, arrivals=arrivals)
                    finally:
                        if writer is not None:
                            writer.close()  # every sample on disk before the trial's line marks it complete
                progress.remove_task(task)
                decode_tokens, decode_s = result.phase_totals("decode_tokens", ("decode", "mixed"))
                prefill_tokens, prefill_s = result.phase_totals("num_tokens", ("prefill",))
                failed = result.activation_errors + sampling_errors(sampling, result.evidence)
                output_tokens = sum(c.output_tokens for c in result.completions)
                idle = not_exercised(cfg, result.evidence, len(requests), base_runtime)
                if failed:
                    activation_failures.append(f"config '{cfg.name}' trial {trial}: " + "; ".join(failed))
                # the steps first: the trial's line in trials.jsonl marks it complete, so a kill between
                # the two leaves an unfinished trial (redone on resume), never a complete one without steps
                steps.extend({"config": cfg.name, "trial": trial, **at, **s} for s in result.steps)
                if steps:  # an HTTP engine reports no steps
                    _write_steps(run_dir, steps)
                append_jsonl(run_dir / "trials.jsonl", {
                    "config": cfg.name, "trial": trial, **at, "wall_s": result.wall_s,
                    "decode_s": decode_s, "decode_tokens": decode_tokens,
                    "prefill_s": prefill_s, "prefill_tokens": prefill_tokens,
                    "output_tokens": output_tokens,
                    "failed_requests": sum(c.error is not None for c in result.completions),
                    "completed_requests": sum(c.error is None for c in result.completions),
                    "evidence": result.evidence, "activation_ok": not failed,
                    "activation_errors": failed, "not_exercised": idle, "expert_load": result.expert_load,
                    "position": [c.name for c in trial_order(configs, trial)].index(cfg.name),
                })
                progress.console.print(
                    f"{cfg.name:>18} trial {trial}{where}: {decode_tokens / max(decode_s, 1e-9):8.1f} decode tok/s, "
                    f"{output_tokens / max(result.wall_s, 1e-9):8.1f} output tok/s (whole run), "
                    f"wall {result.wall_s:6.1f} s"
                )
                if getattr(result, "server_exit", None) is not None:
                    raise ServerDied(cfg.name, trial, result)
    except ServerDied as died:
        write_summary(run_dir)
        console.print(f"[red]error[/red]: {died}; samples so far are kept in {run_dir}")
        raise typer.Exit(1)
    finally:
        backend.close()  # servers it started stop here, on every way out

    write_summary(run_dir)
    if activation_failures:
        # The warm-up proved each strategy can run; a trial whose workload never exercised it is
        # still not a result: say so, keep the files, and fail the command.
        for failure in activation_failures:
            console.print(f"[red]activation failed[/red]: {failure}")
        console.print(f"results kept in {run_dir}; the summary marks these configs activation.ok = false")
        raise typer.Exit(1)


def write_summary(run_dir: Path) -> dict:
    from moebench.results.summary import build_summary

    summary = build_summary(run_dir)
    atomic_write_json(run_dir / "summary.json", summary)
    print_summary(summary, run_dir)
    return summary


def print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"moebench run {summary.get('run_id', run_dir.name)}")
    for col in ("config", "decode tok/s (95% CI)", "speedup (95% CI)", "output tok/s, whole run (95% CI)",
                "speedup (95% CI)", "accuracy", "identical", "activation"):
        table.add_column(col)

    def rate(block: dict) -> str:
        if block.get("median") is None:
            return "-"
        ci = block.get("ci95")
        return f"{block['median']:.1f} ({ci[0]:.1f}-{ci[1]:.1f})" if ci else f"{block['median']:.1f}"

    def ratio(block: dict) -> str:
        ci = block.get("ci95")
        return f"{block['median']:.2f}x ({ci[0]:.2f}-{ci[1]:.2f})" if ci else \
            (f"{block['median']:.2f}x" if block.get("median") is not None else "-")
    for c in summary["configs"]:
        acc = c["accuracy"]
        vs = c.get("vs_baseline") or {}
        table.add_row(
            c["name"],
            rate(c["decode_tokens_per_s"]),
            ratio(vs.get("speedup") or {}),
            rate(c.get("output_tokens_per_s") or {}),
            ratio(vs.get("output_speedup") or {}),
            f"{acc['correct']}/{acc['total']} ({100 * acc['value']:.1f}%)",
            f"{100 * vs['identical_outputs']:.1f}%" if vs.get("identical_outputs") is not None else "-",
            {True: c["activation"].get("status", "ok"), False: "FAILED"}.get(c["activation"]["ok"], "unknown"),
        )
    out = Console()
    if not out.is_terminal:  # CI logs and pipes: the whole table, not one cut at 80 columns
        out.width = max(out.width, out.measure(table, options=out.options.update_width(10_000)).maximum)
    out.print(table)
    if summary.get("serving"):
        out.print(serving_table(summary["serving"]))
    for c in summary["configs"]:
        if c.get("vs_reference"):
            console.print(f"{c['name']} against {c['vs_reference']['config']}: decode speedup "
                          f"{ratio(c['vs_reference']['speedup'])}")
    iv = summary.get("intervals") or {}
    if iv.get("trials"):
        console.print(f"95% intervals: {iv['method']}, {iv['trials']} trials, config order {iv.get('order')}")
    console.print(f"results: {run_dir}")


def serving_table(serving: dict) -> Table:
    """Each config at each offered load: what it achieved, its latency, goodput and the client's send lag."""
    slo = serving.get("slo") or {}
    table = Table(title="offered load" + (" (SLO " + ", ".join(f"{k.removesuffix('_s')} <= {v:g} s"
                                                              for k, v in slo.items()) + ")" if slo else ""))
    for col in ("config", "load", "achieved req/s", "output tok/s", "TTFT p50 / p99 (s)", "TPOT p50 / p99 (s)",
                "e2e p99 (s)", "goodput req/s (95% CI)", "met SLO", "send lag p99 (ms)"):
        table.add_column(col)

    def seconds(v):
        return "-" if v is None else f"{v:.3f}"
    for name, points in serving["configs"].items():
        for label, p in points.items():
            good = p.get("goodput_rps") or {}
            ci = good.get("ci95")
            lag = (p.get("send_lag_s") or {}).get("p99")
            table.add_row(
                name, label, f"{p['achieved_rps']['median'] or 0:.3f}", f"{p['output_tok_s']['median'] or 0:.1f}",
                f"{seconds(p['ttft_s']['p50'])} / {seconds(p['ttft_s']['p99'])}",
                f"{seconds(p['tpot_s']['p50'])} / {seconds(p['tpot_s']['p99'])}",
                seconds(p["latency_s"]["p99"]),
                "-" if good.get("mean") is None else f"{good['mean']:.2f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""),
                "-" if p.get("slo_attainment") is None else f"{100 * p['slo_attainment']:.0f}%",
                "-" if lag is None else f"{1e3 * lag:.1f}")
    return table
