"""The `moebench` command line: one typer app; each command lives in the module that owns it."""

import sys

import typer

from moebench.errors import MoebenchError

app = typer.Typer(
    name="moebench",
    help="Benchmark MoE inference optimizations on GSM8K: decode tokens/s, accuracy, and proof that answers did not change.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

@app.callback()
def _root() -> None:
    """moebench: decode tokens/s, accuracy and a statistical verdict for MoE inference optimizations."""


# Command registrations (one line per command, each module owns its command function).
from moebench import gate, kernels_cli, report, train  # noqa: E402
from moebench.bench_engine import bench_engine_command  # noqa: E402
from moebench.run import run_command  # noqa: E402
from moebench import export_gguf  # noqa: E402
from moebench.engines import llamacpp  # noqa: E402

app.command("run")(run_command)
app.command("report")(report.report_command)
app.command("gate")(gate.gate_command)
app.command("bench-engine")(bench_engine_command)
app.command("train-bundled")(train.train_bundled_command)
app.add_typer(kernels_cli.app, name="kernels", help="MoE kernel microbenchmark and Triton block-size tuning.")
app.add_typer(export_gguf.app, name="export", help="Export a checkpoint for other engines (GGUF for llama.cpp).")
app.add_typer(llamacpp.cli, name="engines", help="Build external engines (llama.cpp's llama-server) ahead of a run.")


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except MoebenchError as e:
        print(f"moebench: error: {e}", file=sys.stderr)
        sys.exit(2)
