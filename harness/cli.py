"""The `moebench` command line: one typer app; each command lives in the module that owns it."""

import sys

import click
import typer

from moebench.errors import MoebenchError

app = typer.Typer(
    name="moebench",
    help="Benchmark MoE inference optimizations on GSM8K: decode tokens/s, accuracy, and proof that answers did not change.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Command registrations (one line per command, each module owns its command function).
from moebench.run import run_command  # noqa: E402

app.command("run")(run_command)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app(standalone_mode=False)
    except MoebenchError as e:
        print(f"moebench: error: {e}", file=sys.stderr)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        print("moebench: interrupted", file=sys.stderr)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("moebench: interrupted", file=sys.stderr)
        sys.exit(130)
