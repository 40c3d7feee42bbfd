"""The `moebench` command line: one typer app; each command's options live in a module of moebench.cli
which calls the layer that does the work.

`moebench --help`, every subcommand's `--help` and every usage error must answer at once, even
on a loaded machine, so a command module imports nothing heavy (torch, transformers, pandas,
matplotlib) at its top: those imports go inside the functions that need them.
tests/architecture/test_cli_help.py holds every registered command to that.
"""

import os
import sys
from contextlib import contextmanager

import typer

from moebench.errors import MoebenchError, describe_os_error

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


# Command registrations: one line per command. Importing a command's module must stay light (no
# torch/transformers/pandas at its top): all of them are imported to answer `moebench --help`.
from moebench.cli import engines, export, gate, kernels, models, plan, profiles, report, train  # noqa: E402
from moebench.cli.lm_eval import lm_eval_command  # noqa: E402
from moebench.cli.run import run_command  # noqa: E402
from moebench.cli.serve import serve_command  # noqa: E402
from moebench.cli.bench_engine import bench_engine_command  # noqa: E402

app.command("run")(run_command)
app.command("report")(report.report_command)
app.command("gate")(gate.gate_command)
app.command("plan")(plan.plan_command)
app.command("bench-engine")(bench_engine_command)
app.command("train-bundled")(train.train_bundled_command)
app.command("serve")(serve_command)
app.command("lm-eval")(lm_eval_command)
app.add_typer(kernels.app, name="kernels", help="MoE kernel microbenchmark and Triton block-size tuning.")
app.add_typer(export.app, name="export", help="Export a checkpoint for other engines (GGUF for llama.cpp).")
app.add_typer(engines.app, name="engines", help="Build external engines (llama.cpp's llama-server) ahead of a run.")
app.add_typer(models.app, name="models", help="Random checkpoints with a named model's structure (models synth).")
app.add_typer(profiles.app, name="profiles", help="Check server profiles' evidence against recorded server output (no server).")


def _show_flags_plainly(command) -> None:
    """typer 0.29 prints a `<bool>` type beside every flag (even --help); a flag takes no value,
    so its type column stays empty, as click and earlier typer versions show it."""
    for param in getattr(command, "params", []):
        if getattr(param, "is_flag", False) and not getattr(param, "count", False):
            param.metavar = ""
    make_help_option = command.get_help_option

    def help_option(ctx):
        option = make_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = help_option
    for sub in (getattr(command, "commands", None) or {}).values():
        _show_flags_plainly(sub)


def build_command():
    """The click command tree of the app, as `main` runs it."""
    command = typer.main.get_command(app)
    _show_flags_plainly(command)
    return command


def _fail(message: str) -> None:
    print(f"moebench: error: {message}", file=sys.stderr)
    sys.exit(2)


# wide enough that no line of a command's output wraps, narrow enough that rich's layouts stay sane
UNWRAPPED_COLUMNS = 1000


@contextmanager
def _whole_lines_without_a_terminal(argv: list[str]):
    """With no terminal on stdin, stdout or stderr (a log file, a pipe, CI), rich lays output out for
    80 columns and cuts longer lines, words and paths included, into pieces that grep and copy-paste
    then miss; lines stay whole instead, for the command's duration. Help keeps its 80-column
    layout; COLUMNS set by the user wins."""
    wide = not (os.environ.get("COLUMNS") or not argv or "--help" in argv)
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            if wide and stream is not None and stream.isatty():
                wide = False  # rich sizes its output to that terminal
        except (AttributeError, ValueError):
            continue
    if not wide:
        yield
        return
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(UNWRAPPED_COLUMNS)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def main() -> None:
    """Console entry point: usage, input and I/O errors become one line on stderr and exit code 2
    (exit 1 keeps its meaning: a failed gate or activation check); Ctrl-C exits 130."""
    command = build_command()
    try:
        with _whole_lines_without_a_terminal(sys.argv[1:]):
            code = command.main(args=sys.argv[1:], prog_name="moebench", standalone_mode=False)
    except typer.TyperException as e:  # click's errors, as typer vendors them: bad usage
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `moebench`: its help, already printed
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _fail(f"{e.format_message()}{hint}")
    except (typer.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort, but not at every point
        print("moebench: aborted", file=sys.stderr)
        sys.exit(130)
    except MoebenchError as e:
        _fail(str(e))
    except OSError as e:  # an unreadable input or unwritable output found while working
        _fail(describe_os_error(e))
    sys.exit(code if isinstance(code, int) else 0)
