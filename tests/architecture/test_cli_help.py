"""`--help` and usage errors answer at once: no command module may import torch, transformers,
pandas or matplotlib at its top (a loaded machine took 15-24 s to import torch for `--help`).

Not timed (a fast machine would hide the problem): each check runs in a fresh interpreter and
looks at what is in sys.modules afterwards."""

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "pandas", "matplotlib")

PROBE = r"""
import json, sys
from moebench.cli.app import build_command, main

HEAVY = %r

def paths(command, prefix=()):
    yield prefix
    for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
        yield from paths(sub, prefix + (name,))

def call(argv):
    sys.argv = ["moebench", *argv]
    try:
        main()
    except SystemExit as e:
        return e.code or 0
    return 0

report = {"after_import": [m for m in HEAVY if m in sys.modules], "help": {}, "errors": {}}
for path in paths(build_command()):
    code = call([*path, "--help"])
    report["help"][" ".join(path) or "(root)"] = [code, [m for m in HEAVY if m in sys.modules]]
for argv in %r:
    code = call(argv)
    report["errors"][" ".join(argv)] = [code, [m for m in HEAVY if m in sys.modules]]
print("REPORT " + json.dumps(report))
"""

USAGE_ERRORS = [
    ["run", "--no-such-option"],
    ["run", "--kernel", "turbo"],
    ["run", "--repeats", "0"],
    ["run", "--limit", "many"],
    ["gate"],
    ["report"],
    ["no-such-command"],
]


def probe(errors=USAGE_ERRORS) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", PROBE % (HEAVY, errors)], capture_output=True, text=True,
                            timeout=300)
    line = next((l for l in result.stdout.splitlines() if l.startswith("REPORT ")), None)
    assert line, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(line[len("REPORT "):]), result.stdout + result.stderr


def test_help_of_every_command_imports_nothing_heavy():
    report, _ = probe(errors=[])
    assert report["after_import"] == [], f"importing moebench.cli.app pulled in {report['after_import']}"
    assert {"(root)", "run", "report", "gate", "train-bundled"} <= set(report["help"])
    for command, (code, heavy) in report["help"].items():
        assert code == 0, command
        assert heavy == [], f"`moebench {command} --help` imported {heavy}: move those imports into functions"


def test_usage_errors_are_one_line_exit_2_and_import_nothing_heavy():
    report, _ = probe()
    for argv, (code, heavy) in report["errors"].items():
        assert code == 2, argv
        assert heavy == [], f"`moebench {argv}` imported {heavy} before refusing its arguments"
    for argv in USAGE_ERRORS:  # the wording, one line each
        result = subprocess.run([sys.executable, "-c", "from moebench.cli.app import main; main()", *argv],
                                capture_output=True, text=True, timeout=120)
        lines = [l for l in result.stderr.splitlines() if l.strip()]
        assert result.returncode == 2 and len(lines) == 1, (argv, result.stderr)
        assert lines[0].startswith("moebench: error: "), lines[0]


def test_flags_show_as_flags_not_bool():
    result = subprocess.run([sys.executable, "-c", "from moebench.cli.app import main; main()", "run", "--help"],
                            capture_output=True, text=True, timeout=120, env={"COLUMNS": "160", "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert "<bool>" not in result.stdout
    ablate = next(l for l in result.stdout.splitlines() if "--ablate" in l)
    assert "Run baseline, each optimization alone" in ablate  # the flag's help, no type in between
