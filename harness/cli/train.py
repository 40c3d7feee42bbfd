"""`moebench train-bundled`: the command line of moebench.models.train (which needs torch, so it is
imported only when training starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

# Not the bundled model's own folder inside the installed package: retraining must not silently
# replace the model that every default run uses. Pass that folder as --out to mean it.
DEFAULT_OUT = Path("trained") / "gsm-synth-moe"
DEFAULT_OUTS = {"easy": DEFAULT_OUT, "hard": Path("trained") / "gsm-synth-hard-moe",
                "hard-wide": Path("trained") / "gsm-synth-hard-wide-moe"}


def train_bundled_command(
    out: Annotated[Optional[Path], typer.Option(help="Output folder for the checkpoint (default: trained/gsm-synth-moe, "
                                                     "or trained/gsm-synth-hard-moe with --level hard). The model moebench ships "
                                                     "(moebench/bundled/...) is replaced only if --out names its folder.")] = None,
    level: Annotated[str, typer.Option(help="Which level of the synthetic suite to train for: easy (gsm-synth, the "
                                            "default model), hard (gsm-synth-hard; docs/gsm-synth-hard.md) or hard-wide (its stories with "
                                            "wider numbers: the first stage of the hard level's model).")] = "easy",
    minutes: Annotated[float, typer.Option(help="Wall-time cap for training (minutes).")] = 45.0,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    steps: Annotated[int, typer.Option(help="Optimizer steps (the time budget may stop training earlier).")] = 3200,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 16,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 3e-3,
    eval_every: Annotated[int, typer.Option(help="Steps between held-out greedy evals (0: never).")] = 300,
    init_from: Annotated[Optional[Path], typer.Option(help="Start from this bundle's weights and tokenizer instead of "
                                                           "random ones (same shape as --level's; e.g. the easy level's "
                                                           "model for the hard level).")] = None,
    threads: Annotated[int, typer.Option(help="torch CPU threads (1 is fastest on a shared machine).")] = 1,
    mtp: Annotated[bool, typer.Option("--mtp", help="Instead: train a multi-token-prediction head for the bundled "
                                                    "model (base frozen) and write the model plus mtp.safetensors to "
                                                    "--out (--speculative mtp drafts with it; moebench/models/train_mtp.py).")] = False,
    mtp_steps: Annotated[int, typer.Option(help="With --mtp: optimizer steps.")] = 1500,
    mtp_minutes: Annotated[float, typer.Option(help="With --mtp: wall-time cap (minutes).")] = 16.0,
) -> None:
    """Train the bundled gsm-synth MoE (qwen3_moe) and evaluate it on the synthetic test split (--mtp: its MTP head;
    --level hard: the model for gsm-synth-hard)."""
    from moebench.errors import MoebenchError
    from moebench.fileio import ensure_writable_dir

    if level not in DEFAULT_OUTS:
        raise MoebenchError(f"--level {level!r}: choose from {', '.join(DEFAULT_OUTS)}")
    if mtp and level != "easy":
        raise MoebenchError("--mtp trains a head for the easy level's model only")
    if init_from is not None and not (init_from / "model.safetensors").is_file():
        raise MoebenchError(f"--init-from {init_from}: no model.safetensors there")
    out = ensure_writable_dir(out if out is not None else DEFAULT_OUTS[level], "--out")
    log_file = out / ("mtp_train_log.txt" if mtp else "train_log.txt")
    log_file.write_text("")

    def log(msg):
        print(msg, flush=True)
        with log_file.open("a") as f:
            f.write(msg + "\n")

    if mtp:
        from moebench.models.train_mtp import train_mtp

        train_mtp(out=out, minutes=mtp_minutes, seed=seed, steps=mtp_steps, batch_size=batch_size, threads=threads, log=log)
        return
    from moebench.models.train import train

    train(out=out, minutes=minutes, seed=seed, steps=steps, batch_size=batch_size, lr=lr,
          eval_every=eval_every, threads=threads, log=log, level=level, init_from=init_from)
