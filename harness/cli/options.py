"""Command-line options shared by several commands, each defined once (typer only: `--help` must
not import the engine)."""

from __future__ import annotations

from typing import Optional

import typer

# The runtime's settings, one definition each for run, serve and lm-eval (one set of defaults: the
# same flag never means two things in two commands).
KERNEL = typer.Option("naive", "--kernel", help="MoE kernel: naive (per-expert loop) or fused. It selects the MoE op and nothing else.")
SCHEDULER = typer.Option(
    "static", "--scheduler",
    help="Batching: static (requests that arrive together form a batch; the next starts when it ends) or "
         "continuous (requests join the running batch at the next step).")
PREFETCH = typer.Option("off", "--prefetch", help="Expert prefetch: off or lookahead.")
BATCH_SIZE = typer.Option(16, "--batch-size", help="Maximum requests running at once.")
EXPERT_BUDGET = typer.Option(
    None, "--expert-budget",
    help="Fraction of routed-expert weights kept resident (e.g. 0.5) or a size (8GB). Default 1.0 "
         "(0.5 for `run --ablate` on the bundled model, where offloading is part of what it measures).")
OFFLOAD_TIER = typer.Option(
    "auto", "--offload-tier",
    help="Where non-resident experts live: auto (disk on a CPU, pinned host memory on CUDA), disk, or host "
         "(on a CPU a synthetic RAM-to-RAM setting).")
ADMISSION = typer.Option("affinity", "--admission", help="Continuous batching admission: affinity or fifo.")
DECODE_PATH = typer.Option(
    "auto", "--decode-path",
    help="How decode steps run, for every config alike: chained (the C++ step ops layer by layer, on the "
         "step's thread pool), native (every layer in one C++ call; needs kernel=fused, every expert resident, "
         "prefetch off and every layer an MoE layer; with --ablate, add decode-path to --axes), eager (each op "
         "from Python, torch's threads), auto (chained where the C++ ops run, else eager).")
DEVICE = typer.Option("cpu", "--device", help="cpu (float32) or cuda (bfloat16).")
THREADS = typer.Option(
    None, "--threads",
    help="torch CPU threads. Default on CPU: 1 (measured here: with 2 threads on a busy 2-core machine, OpenMP "
         "hand-offs made small ops 30-60x slower and faked large speedups); 0 = torch's own choice.")
LM_HEAD = typer.Option(
    None, "--lm-head",
    help="LM head weight precision: f32 (default, as loaded), bf16, int8 or fp8 (e4m3; int8 and fp8 with a "
         "scale per output row; float32 accumulation). Approximate: answers may change. With --ablate and lm-head "
         "in --axes, several comma-separated (int8,fp8) are ablated together.")

WEIGHTS = typer.Option(
    "f32", "--weights",
    help="Weight precision of what a decode step streams besides the LM head (attention projections, dense "
         "MLPs, routed experts): f32 (default: the checkpoint's own, float32 or bfloat16), int8 (one float32 "
         "scale per output row) or int4 (a float16 scale per group of 32 inputs, llama.cpp's Q4_0 blocks); "
         "weight-only, float32 accumulation, routers stay float32. Approximate: answers may change "
         "(docs/int8.md, docs/int4.md).")


def cpu_threads(threads: Optional[int], device: str) -> Optional[int]:
    """The torch thread count a command sets: 1 on the CPU unless given; None leaves torch's own."""
    from moebench.errors import MoebenchError

    if threads is not None and threads < 0:
        raise MoebenchError(f"--threads must be >= 0, got {threads}")
    if threads is None:
        return 1 if device == "cpu" else None
    return threads or None


SAMPLING_PANEL = "Sampling"

TEMPERATURE = typer.Option(
    0.0, "--temperature", rich_help_panel=SAMPLING_PANEL,
    help="Sampling temperature (0 = greedy). Each request draws from its own stream, seeded from "
         "(--seed, trial, item id) in `run` and from the request's `seed` in `serve`.")
TOP_P = typer.Option(
    None, "--top-p", rich_help_panel=SAMPLING_PANEL,
    help="Nucleus sampling: keep the most likely tokens whose probability adds up to this (0 < p <= 1; "
         "needs --temperature > 0).")
TOP_K = typer.Option(
    None, "--top-k", rich_help_panel=SAMPLING_PANEL,
    help="Keep only the K most likely tokens (K >= 1; needs --temperature > 0).")


SPECULATIVE_PANEL = "Speculative decoding"

SPECULATIVE = typer.Option(
    "off", "--speculative", rich_help_panel=SPECULATIVE_PANEL,
    help="off, ngram: prompt-lookup drafts (the longest recent 3..1-gram found earlier in prompt + output "
         "proposes what followed it), or mtp: the checkpoint's multi-token-prediction head drafts (config "
         "num_nextn_predict_layers; the bundled model has one); verified in one decode forward. Exact: the emitted "
         "tokens are plain decoding's, greedy or sampled (docs/speculative.md). With --ablate, the speculative axis of --axes.")
SPEC_TOKENS = typer.Option(
    4, "--spec-tokens", rich_help_panel=SPECULATIVE_PANEL, help="Draft tokens per sequence and verify step (1..16).")
SPEC_MAX_BATCH = typer.Option(
    None, "--spec-max-batch", rich_help_panel=SPECULATIVE_PANEL,
    help="Steps with more sequences than this run without drafts (vLLM's disable-by-batch-size). Default: the "
         "method's own, measured on the bundled model (docs/speculative.md, Policy): ngram 1 (verification costs "
         "more than it saves at every larger batch), mtp any batch size; give --batch-size or more to draft in every step.")
