"""`moebench run`: its options, turned into the run's typed arguments (moebench.measuring.args.RunArgs,
the manifest's `args`); the run itself is moebench.measuring.run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moebench.cli.options import (ADMISSION, BATCH_SIZE, DECODE_PATH, DEVICE, EXPERT_BUDGET, KERNEL, LM_HEAD, OFFLOAD_TIER, WEIGHTS,
                                  PREFETCH, SCHEDULER, SPEC_MAX_BATCH, SPEC_TOKENS, SPECULATIVE, TEMPERATURE, THREADS,
                                  TOP_K, TOP_P)


def run_command(
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory (config.json, *.safetensors, tokenizer.json). Default: the bundled gsm-synth MoE."),
    suite: str = typer.Option("gsm-synth", "--suite", help="Suite: gsm-synth (bundled, default), gsm8k (5-shot), gsm8k_cot (8-shot)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Directory with GSM8K test.jsonl/train.jsonl (else $MOEBENCH_GSM8K_DIR, else the openai/gsm8k hub data set)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N items of the suite (default: all; 200 for the bundled gsm-synth suite, so the default job takes minutes)."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples per prompt (default: the prompt format's)."),
    kernel: str = KERNEL,
    scheduler: str = SCHEDULER,
    prefetch: str = PREFETCH,
    ablate: bool = typer.Option(False, "--ablate", help="Run baseline, each optimization alone, and all stacked, interleaved."),
    factorial: bool = typer.Option(False, "--factorial", help="With --ablate: every combination of the switches (2^3)."),
    axes: Optional[str] = typer.Option(None, "--axes", help="With --ablate: the axes to ablate, comma-separated from kernel, scheduler, prefetch, speculative, lm-head, weights, decode-path (default: the three switches). speculative adds speculative=METHOD (--speculative, default ngram) and, with switches, all+speculative=METHOD; exact like the switches. lm-head is approximate: its configs (lm-head=bf16/int8/fp8, or the one --lm-head names) get accuracy verdicts, no identical-output claim; so is weights (weights=int8). decode-path adds decode-path=native (the fused kernel, every layer of a decode step in one C++ call; every expert resident) with its own speedup against kernel (the fused kernel on the chained path)."),
    lm_head: Optional[str] = LM_HEAD,
    weights: str = WEIGHTS,
    approximate_stacked: bool = typer.Option(False, "--approximate-stacked", help="With --ablate: the approximate configs (lm-head, weights) only on top of every ablated switch, not also alone. The switches are exact, so each is still judged against the baseline, at the fused kernel's cost instead of twice (how the reference protocol fits 1319 items x 5 trials in an hour on 2 cores)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Trials per config (default 3 with --ablate, else 1)."),
    warmup: int = typer.Option(4, "--warmup", help="Items run per config before measuring (also checks activation)."),
    batch_size: int = BATCH_SIZE,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Generation limit per request (a hit counts as a truncation)."),
    expert_budget: Optional[str] = EXPERT_BUDGET,
    offload_tier: str = OFFLOAD_TIER,
    admission: str = ADMISSION,
    decode_path: str = DECODE_PATH,
    device: str = DEVICE,
    threads: Optional[int] = THREADS,
    seed: int = typer.Option(0, "--seed", help="Run seed: with --temperature > 0 each request samples from its own stream, seeded from (this seed, trial, item id)."),
    out: Path = typer.Option(Path("results"), "--out", help="Parent directory of the run directory."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Name of the run directory (default: time to the millisecond, a random suffix, model and suite). A name that exists is refused; continue that run with --resume."),
    negative_control_: Optional[str] = typer.Option(None, "--negative-control", help="Add an approximate config that SHOULD change answers (int4, int3 or int2 round-to-nearest experts), proving the accuracy check has power."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue an interrupted run directory with its own manifest."),
    engine: str = typer.Option("bundled", "--engine", help="bundled (the in-process runtime) or openai (an OpenAI-compatible server over HTTP).", rich_help_panel="Serving engines"),
    base_url: Optional[str] = typer.Option(None, "--base-url", help="With --engine openai: a server already running, e.g. http://127.0.0.1:8000.", rich_help_panel="Serving engines"),
    profiles: Optional[Path] = typer.Option(None, "--profiles", help="With --engine openai: a profile file (profiles/*.toml); moebench starts each configuration's server itself.", rich_help_panel="Serving engines"),
    profile: Optional[list[str]] = typer.Option(None, "--profile", help="Only these profiles of --profiles (repeatable; the baseline is always kept).", rich_help_panel="Serving engines"),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="The request's model name (default: the profile's, else the server's first /v1/models id).", rich_help_panel="Serving engines"),
    tokenizer_dir: Optional[Path] = typer.Option(None, "--tokenizer", help="A directory with tokenizer.json: prompts go as token ids, so the server's tokenizer cannot change them (default: the profile's).", rich_help_panel="Serving engines"),
    chat: bool = typer.Option(False, "--chat", help="Send /v1/chat/completions (one user message) instead of /v1/completions.", rich_help_panel="Serving engines"),
    concurrency: int = typer.Option(16, "--concurrency", help="Requests in flight at once, in the closed loop (with --request-rate each request is sent at its time, whatever is in flight).", rich_help_panel="Serving engines"),
    temperature: float = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    speculative: str = SPECULATIVE,
    spec_tokens: int = SPEC_TOKENS,
    spec_max_batch: Optional[int] = SPEC_MAX_BATCH,
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds one request may take.", rich_help_panel="Serving engines"),
    request_rate: Optional[str] = typer.Option(None, "--request-rate", help="Open loop: requests sent at this rate (requests/s), comma-separated for a sweep run within every trial, 'inf' for the closed loop, e.g. 2,4,8,inf. The same seeded arrival times for every config and trial (docs/serving-load.md).", rich_help_panel="Offered load"),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of the gaps between arrivals: 1 Poisson, below 1 burstier, above 1 steadier (as vLLM's bench serve).", rich_help_panel="Offered load"),
    fluctuate: Optional[str] = typer.Option(None, "--fluctuate", help="LOW,HIGH,SECONDS: a load that alternates LOW and HIGH requests/s every SECONDS; the summary gives throughput per window and its stability.", rich_help_panel="Offered load"),
    arrivals: Optional[Path] = typer.Option(None, "--arrivals", help="A trace of send times (one number of seconds per line) as one more load.", rich_help_panel="Offered load"),
    slo: Optional[list[str]] = typer.Option(None, "--slo", help="A latency SLO a request must meet to count in goodput, METRIC=SECONDS with METRIC ttft, tpot or e2e (repeatable).", rich_help_panel="Offered load"),
):
    """Generate answers for every item and config, score them, and write results/<run-id>/."""
    from moebench.measuring.args import RunArgs
    from moebench.measuring.run import read_manifest, start_run

    if resume is not None:
        args = RunArgs.from_dict(read_manifest(resume)["args"])
    else:
        args = RunArgs(
            model=str(model) if model else None, suite=suite, data=str(data) if data else None, limit=limit,
            num_fewshot=num_fewshot, kernel=kernel, scheduler=scheduler, prefetch=prefetch, ablate=ablate,
            factorial=factorial, axes=axes, lm_head=lm_head, weights=weights, approximate_stacked=approximate_stacked, repeats=repeats, warmup=warmup,
            batch_size=batch_size, max_new_tokens=max_new_tokens, expert_budget=expert_budget,
            offload_tier=offload_tier, admission=admission, decode_path=decode_path, device=device, seed=seed,
            negative_control=negative_control_, threads=threads,
            engine=engine, base_url=base_url, profiles=str(profiles) if profiles else None, profile=profile or None,
            served_model=served_model, tokenizer=str(tokenizer_dir) if tokenizer_dir else None, chat=chat,
            concurrency=concurrency, temperature=temperature, top_p=top_p, top_k=top_k,
            speculative=speculative, spec_tokens=spec_tokens, spec_max_batch=spec_max_batch,
            request_timeout=request_timeout, request_rate=request_rate, burstiness=burstiness,
            fluctuate=fluctuate, arrivals=str(arrivals) if arrivals else None, slo=tuple(slo) if slo else None,
        )
    start_run(args, out, run_id, resume)
