"""`moebench engines build-llamacpp`: the command; the build is moebench.backends.llamacpp."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command("build-llamacpp")
def build_llamacpp_command() -> None:
    """Build (or find cached) llama.cpp's llama-server and llama-batched-bench for this CPU and export
    the bundled model to GGUF."""
    from moebench.backends.llamacpp import bundled_gguf_path, llama_batched_bench_path, llama_server_path

    typer.echo(llama_server_path())
    typer.echo(llama_batched_bench_path())
    typer.echo(bundled_gguf_path())
