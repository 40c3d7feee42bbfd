"""Command-line options shared by several commands, each defined once (typer only: `--help` must
not import the engine)."""

from __future__ import annotations

from typing import Optional

import typer

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


def check_sampling_options(temperature: float, top_p: Optional[float], top_k: Optional[int]) -> None:
    """Refuse what no engine can honour: a bad value, or a top-p / top-k cut beside greedy decoding
    (which would be recorded and silently ignored)."""
    from moebench.errors import MoebenchError

    if temperature is None or not temperature >= 0 or temperature == float("inf"):
        raise MoebenchError(f"--temperature must be a finite number >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise MoebenchError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise MoebenchError(f"--top-k must be >= 1 (or unset), got {top_k}")
    if temperature == 0 and (top_p not in (None, 1) or top_k is not None):
        raise MoebenchError("--top-p and --top-k need --temperature > 0 (greedy decoding would ignore them)")


SPECULATIVE_PANEL = "Speculative decoding"

SPECULATIVE = typer.Option(
    "off", "--speculative", rich_help_panel=SPECULATIVE_PANEL,
    help="off, or ngram: prompt-lookup drafts (the longest recent 3..1-gram found earlier in prompt + output "
         "proposes what followed it), verified in one decode forward. Exact: the emitted tokens are plain "
         "decoding's, greedy or sampled (docs/speculative.md). With --ablate, the speculative axis of --axes.")
SPEC_TOKENS = typer.Option(
    4, "--spec-tokens", rich_help_panel=SPECULATIVE_PANEL, help="Draft tokens per sequence and verify step (1..16).")
SPEC_MAX_BATCH = typer.Option(
    None, "--spec-max-batch", rich_help_panel=SPECULATIVE_PANEL,
    help="Steps with more sequences than this run without drafts (verification costs more than it saves "
         "in large batches); default: any batch size.")
