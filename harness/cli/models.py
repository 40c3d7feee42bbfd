"""`moebench models synth`: its options; the checkpoints are moebench.models.synth."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from moebench.models.synth import SHAPES, make_synth_model
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command("synth")
def synth_command(
    shape: Annotated[str, typer.Option(help=f"Model shape: {', '.join(SHAPES)}.")] = "ling3-flash-scaled",
    out: Annotated[Path, typer.Option(help="Directory to write the checkpoint to.")] = Path("models/ling3-flash-scaled"),
    data: Annotated[Optional[Path], typer.Option(
        help="GSM8K data directory (train.jsonl trains the tokenizer); default $MOEBENCH_GSM8K_DIR, else the bundled model's tokenizer.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
    dtype: Annotated[str, typer.Option(help="Weights' dtype on disk: bfloat16 or float32.")] = "bfloat16",
) -> None:
    """Write a random checkpoint with a named model's structure, scaled to fit this machine, plus its model card."""

    from moebench.suites.gsm8k import DATA_DIR_ENV

    data_dir = data or (Path(os.environ[DATA_DIR_ENV]) if os.environ.get(DATA_DIR_ENV) else None)
    path = make_synth_model(shape, out, data_dir, seed, dtype)
    card = json.loads((path / "model_card.json").read_text())
    typer.echo(f"wrote {path} ({card['parameters'] / 1e6:.0f}M parameters, {shape}); "
               f"model card: {path / 'README.md'}")
