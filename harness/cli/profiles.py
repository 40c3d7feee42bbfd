"""`moebench profiles check FILE`: a profile's evidence judged against recorded server output,
without a server. Per configuration: which evidence would prove it (it holds on the
configuration's own recorded output and fails on the baseline's), which is shared with the
baseline on purpose, and which would not prove it (it holds for the baseline too). A profile with
evidence that does not discriminate, or that fails on its own configuration's recorded output,
exits 2 with one line naming the entry: the same refusal `moebench run` makes at warm-up.
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


def check_profile(path: Path, recorded: Path | None = None, echo=print) -> list[str]:
    """Print the judgement of every configuration; return the problems (none: the profile passes)."""
    from moebench.backends.discrimination import judge
    from moebench.backends.evidence import evaluate, must_items
    from moebench.backends.profiles import load_profiles
    from glob import escape as glob_escape

    from moebench.backends.recorded import load_observation, recorded_folder

    pf = load_profiles(path)
    folder = recorded_folder(recorded if recorded is not None else pf.recorded_dir)
    base = pf.baseline
    base_obs = load_observation(folder, base.name)
    if base_obs is None:
        from moebench.errors import MoebenchError

        raise MoebenchError(f"{folder}: no recorded output of the baseline ({base.name}.log)")
    engine = pf.checked.get("engine", "not named in the profile")
    echo(f"{pf.path}: checked against {engine}; recorded output in {folder}")
    problems: list[str] = []  # evidence that does not discriminate
    failing: list[str] = []  # evidence that fails on its own configuration's output
    for profile in pf.profiles:
        own = load_observation(folder, profile.name)
        echo(f"\n[{profile.name}]" + (" (baseline)" if profile is base else "") +
             (" (approximate)" if profile.approximate else ""))
        if profile is not base:
            verdict = judge(profile, base_obs)
            for item in verdict.proving:
                echo(f"  proves it (the baseline fails it): {item.label}")
            for item, seen in verdict.shared:
                echo(f"  shared with the baseline on purpose, proves nothing alone: {item.label}")
            for item, seen in verdict.refused:
                echo(f"  does NOT prove it, the baseline shows it too: {item.label} (there: {str(seen)[:80]!r})")
            problem = verdict.problem(base.name)
            if problem:
                problems.append(f"{pf.path}: {problem}")
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
        if errors:
            failing.append(f"{pf.path}: profile '{profile.name}': its evidence fails on its own recorded output "
                           f"({own.source}): {errors[0]}")
    return problems + failing


@app.command("check")
def check_command(
    file: Path = typer.Argument(..., help="A profile file (TOML)."),
    recorded: Path = typer.Option(None, "--recorded", help="A folder of recorded server output, <config>.log and "
                                  "<config>.endpoints.json (default: the profile's [checked] recorded)."),
) -> None:
    """Print, per configuration, the evidence that would prove it and what would not; exit 2 if a
    configuration's evidence also holds for the baseline or fails on its own recorded output."""
    from moebench.errors import MoebenchError

    problems = check_profile(file, recorded)
    if problems:
        more = f" (and {len(problems) - 1} more above)" if len(problems) > 1 else ""
        raise MoebenchError(problems[0] + more)
    print("\nevery configuration has evidence of its own")


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
