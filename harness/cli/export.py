"""`moebench export gguf`: its options; the writer is moebench.models.export_gguf."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moebench.models.export_gguf import _bundled_model, export_gguf
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command("gguf")
def gguf_command(
    out: Annotated[Path, typer.Option("--out", help="The GGUF file to write.")],
    model: Annotated[Optional[Path], typer.Option("--model", help="Checkpoint directory (default: the bundled gsm-synth-moe).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Weight type: f32 (exact, default), f16, bf16 (exact for a bf16 checkpoint), q8_0, or q4_0 (the bytes of --weights int4, with a Q8_0 LM head and f32 embeddings; docs/int4.md). Norms and routers stay f32.")] = "f32",
) -> None:
    """Convert a qwen3_moe or mixtral checkpoint (safetensors) to a GGUF file for llama.cpp, tokenizer included."""
    path = export_gguf(model or _bundled_model(), out, dtype)
    typer.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
