"""`moebench profiles check FILE`: a profile's evidence judged against recorded server output,
without a server. Per configuration and per optimization it enables: the evidence that proves it,
by kind (runtime: it changes only when the optimization ran; echo: the server repeating its
arguments), what is shared on purpose, and what would not prove it (it holds for a configuration
that lacks the optimization). A profile whose evidence does not discriminate, proves an
optimization by echo alone without `echo_only = true` and a reason, or fails on its own
configuration's recorded output, exits 2 with one line naming the entry: the same refusal
`moebench run` makes at warm-up.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Check server profiles (the evidence that proves each configuration) without a server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _profiles() -> None:
    """Server profiles: the configurations of an engine and the evidence that proves each."""


def _print_verdict(verdict, echo) -> None:
    for optimization in verdict.profile.enables:
        items = verdict.proofs.get(optimization, [])
        runtime = [i.label for i in items if i.kind == "runtime"]
        echoed = [i.label for i in items if i.kind == "echo"]
        echo(f"  {optimization}: runtime {len(runtime)}, echo {len(echoed)}")
        for label in runtime:
            echo(f"    runtime: {label}")
        for label in echoed:
            echo(f"    echo: {label}")
    for item, _ in verdict.shared:
        echo(f"  shared on purpose, proves nothing alone: {item.label}")
    for item, other, seen in verdict.refused:
        echo(f"  does NOT prove it, '{other}' shows it too: {item.label} (there: {str(seen)[:80]!r})")
    if verdict.profile.echo_only:
        echo(f"  echo-only (marked): {verdict.profile.echo_only}")


def check_profile(path: Path, recorded: Path | None = None, echo=print) -> list[str]:
    """Print the judgement of every configuration; return the problems (none: the profile passes)."""
    from glob import escape as glob_escape

    from moebench.backends.discrimination import judge
    from moebench.backends.evidence import evaluate, must_items
    from moebench.backends.profiles import load_profiles
    from moebench.backends.recorded import load_observation, recorded_folder
    from moebench.errors import MoebenchError

    pf = load_profiles(path)
    folder = recorded_folder(recorded if recorded is not None else pf.recorded_dir)
    base = pf.baseline
    observations = {p.name: obs for p in pf.profiles if (obs := load_observation(folder, p.name)) is not None}
    if base.name not in observations:
        raise MoebenchError(f"{folder}: no recorded output of the baseline ({base.name}.log)")
    engine = pf.checked.get("engine", "not named in the profile")
    echo(f"{pf.path}: checked against {engine}; recorded output in {folder}")
    problems: list[str] = []  # evidence that does not discriminate, or echo alone
    failing: list[str] = []  # evidence that fails on its own configuration's output
    marked: list[str] = []
    for profile in pf.profiles:
        own = observations.get(profile.name)
        echo(f"\n[{profile.name}]" + (" (baseline)" if profile is base else f" enables {', '.join(profile.enables)}")
             + (" (approximate)" if profile.approximate else ""))
        if profile is not base:
            verdict = judge(profile, observations, pf.profiles, base.name)
            _print_verdict(verdict, echo)
            problem = verdict.problem()
            if problem:
                problems.append(f"{pf.path}: {problem}")
            elif profile.echo_only:
                marked.append(f"{profile.name} ({', '.join(verdict.echo_proved)}: {profile.echo_only})")
        else:
            for item in must_items(profile.evidence):
                echo(f"  required of the baseline: {item.label}")
        for negative in sorted(folder.glob(f"{glob_escape(profile.name)}.*.log")):
            label = negative.name[:-len(".log")]
            refusals = [e for when in ("start", "end")
                        for e in evaluate(profile.evidence, when, load_observation(folder, label))[1]]
            echo(f"  refuses {negative.name} (output that must not prove it): "
                 + (refusals[0] if refusals else "NO, its evidence accepts it"))
            if not refusals:
                problems.append(f"{pf.path}: profile '{profile.name}': its evidence accepts {negative}, "
                                "output recorded as not proving it")
        if own is None:
            echo(f"  no recorded output of this configuration ({profile.name}.log): its own evidence is not checked")
            continue
        errors = [e for when in ("start", "end") for e in evaluate(profile.evidence, when, own)[1]]
        echo("  on its own recorded output: " + ("every item holds" if not errors else "; ".join(errors)))
        if own.not_exercised:
            echo("  not exercised on its recorded output (no proof either way): " + "; ".join(own.not_exercised))
        if errors:
            failing.append(f"{pf.path}: profile '{profile.name}': its evidence fails on its own recorded output "
                           f"({own.source}): {errors[0]}")
    if marked:
        echo("\necho-only, marked in the profile: " + "; ".join(marked))
    return problems + failing


@app.command("check")
def check_command(
    file: Path = typer.Argument(..., help="A profile file (TOML)."),
    recorded: Path = typer.Option(None, "--recorded", help="A folder of recorded server output, <config>.log and "
                                  "<config>.endpoints.json (default: the profile's [checked] recorded)."),
) -> None:
    """Print, per configuration and optimization, its runtime and echo evidence and what would not
    prove it; exit 2 if evidence also holds for a configuration without the optimization, proves it
    by echo alone (unless marked echo_only), or fails on its own recorded output."""
    from moebench.errors import MoebenchError

    problems = check_profile(file, recorded)
    if problems:
        more = f" (and {len(problems) - 1} more above)" if len(problems) > 1 else ""
        raise MoebenchError(problems[0] + more)
    print("\nevery configuration has evidence of its own, at runtime unless marked echo-only")


@app.command("record")
def record_command(
    file: Path = typer.Argument(..., help="A profile file (TOML)."),
    out: Path = typer.Option(..., "--out", help="The folder to write <config>.log and <config>.endpoints.json into."),
    model: Path = typer.Option(None, "--model", help="Fills {model} in the profile's command."),
    threads: int = typer.Option(1, "--threads", help="Fills {threads} in the profile's command."),
    requests: int = typer.Option(4, "--requests", help="Requests sent to each configuration's server (gsm-synth prompts)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens per request."),
) -> None:
    """Start each configuration's server, send a few requests, and keep its log and the bodies of
    every endpoint the profile's evidence reads: the recorded output `profiles check` judges."""
    from moebench.backends.openai import ClientOptions
    from moebench.backends.profiles import load_profiles
    from moebench.backends.record import record_profiles
    from moebench.backends.server import Placeholders
    from moebench.errors import MoebenchError
    from moebench.measuring.measure import _requests
    from moebench.suites import load_suite

    if requests < 1 or max_new_tokens < 1:
        raise MoebenchError("--requests and --max-new-tokens must be >= 1")
    pf = load_profiles(file)
    placeholders = Placeholders("127.0.0.1", str(model) if model else None, pf.server.get("served_model"), threads)
    tokenizer = None
    if pf.server.get("tokenizer"):
        from tokenizers import Tokenizer

        path = Path(placeholders.fill(pf.server["tokenizer"])) / "tokenizer.json"
        if not path.is_file():
            raise MoebenchError(f"{path}: no such file (the profile's tokenizer)")
        tokenizer = Tokenizer.from_file(str(path))
    suite = load_suite("gsm-synth", None, requests)
    record_profiles(pf, out, placeholders, _requests(suite, suite.items, max_new_tokens),
                    ClientOptions(concurrency=requests), tokenizer)
