"""Issue 16: runs started together, killed, resumed after a torn write, or pointed at an unwritable
path keep working and lose nothing; every failure is one line with exit code 2."""

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from child_signals import interruptible
from moebench.cli.app import main
from moebench.fileio import append_jsonl, drop_torn_tail, read_jsonl
from moebench.errors import MoebenchError
from tiny_models import make_tiny_checkpoint, write_char_tokenizer
from repo_paths import REPO


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3_e5_k1")
    return write_char_tokenizer(path)


def write_data(directory: Path, items: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"What is {i} + 3?", "answer": f"{i} + 3 = <<{i}+3={i + 3}>>{i + 3}\n#### {i + 3}"}
            for i in range(items)]
    for name in ("test.jsonl", "train.jsonl"):
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"), 3)


def run_args(model, data, out, *extra):
    return ["run", "--model", str(model), "--suite", "gsm8k", "--data", str(data), "--num-fewshot", "0",
            "--max-new-tokens", "4", "--warmup", "0", "--out", str(out), *map(str, extra)]


def cli(capsys, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["moebench", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    return exc.value.code or 0, captured.out, captured.err


def one_line_error(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- 1. pinned tools, fresh installs

def test_test_tools_are_pinned_exactly_and_installed_as_pinned():
    """A machine's leftover pytest must not decide whether CI passes (pytest 9.2 changed approx())."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    test_tools = project["optional-dependencies"]["test"]
    assert test_tools, "the [test] extra names the test tools"
    for requirement in test_tools:
        name, sep, pinned = requirement.partition("==")
        assert sep and pinned, f"test tool not pinned exactly: {requirement}"
        assert version(name.strip()) == pinned.strip(), (
            f"{name} {version(name.strip())} is installed but pyproject pins {pinned}: "
            "reinstall with pip install -e '.[test]'")


def test_no_tracked_file_is_also_git_ignored():
    """gate.toml (and everything else committed) must not be matched by .gitignore."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    assert listed == [], f"tracked but ignored: {listed}"


# ---------------------------------------------------------------- 3. two runs at once

def test_two_runs_started_together_get_separate_folders(model, data, tmp_path):
    """Started in the same instant, each run writes its own folder with its own samples only."""
    out = tmp_path / "results"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "from moebench.cli.app import main; main()", *run_args(model, data, out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-2000:]
    runs = sorted(out.iterdir())
    assert len(runs) == 2, runs
    for run in runs:
        samples = read_jsonl(run / "samples.jsonl")
        assert sorted((s["trial"], s["item_id"]) for s in samples) == sorted(
            {(s["trial"], s["item_id"]) for s in samples}), "an item twice in one trial: two runs merged"
        assert len(samples) == 3 and len(read_jsonl(run / "trials.jsonl")) == 1
    for stdout, _ in results:  # and each says what to do next
        assert "next: moebench report" in stdout and "moebench gate" in stdout


def test_an_existing_run_id_is_refused_before_any_work(capsys, monkeypatch, tmp_path):
    """Even an empty folder: the id is taken. Refused before the model loads (--model is bogus here)."""
    (tmp_path / "results" / "taken").mkdir(parents=True)
    code, _, err = cli(capsys, monkeypatch, "run", "--model", tmp_path / "no-model", "--out", tmp_path / "results",
                       "--run-id", "taken")
    one_line_error(code, err, "already exists", "--resume")


def test_run_id_must_be_a_plain_name(capsys, monkeypatch, tmp_path):
    code, _, err = cli(capsys, monkeypatch, "run", "--out", tmp_path, "--run-id", "../elsewhere")
    one_line_error(code, err, "--run-id")


def test_a_run_being_written_is_not_resumed_twice(model, data, capsys, monkeypatch, tmp_path):
    """The writer holds a lock on its folder; a second --resume of the same run is refused."""
    code, _, err = cli(capsys, monkeypatch, *run_args(model, data, tmp_path, "--run-id", "r"))
    assert code == 0, err
    run = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(run)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = cli(capsys, monkeypatch, "run", "--resume", run)
        one_line_error(code, err, "another moebench process is writing this run")
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------- 4. unwritable output paths

def test_run_out_under_a_regular_file_fails_at_once(capsys, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = cli(capsys, monkeypatch, "run", "--model", tmp_path / "no-model", "--out", blocker / "results")
    one_line_error(code, err, "--out", "cannot write there")
    assert not list(tmp_path.glob("**/manifest.json"))


def test_run_out_on_a_read_only_filesystem_fails_at_once(capsys, monkeypatch, tmp_path):
    """A read-only mount (what root's permissions cannot override); needs the right to mount."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a read-only tmpfs is not permitted here")
    try:
        code, _, err = cli(capsys, monkeypatch, "run", "--model", tmp_path / "no-model", "--out", mnt / "results")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    one_line_error(code, err, "--out", "Read-only file system")


def test_report_out_unwritable_is_exit_2_not_1(capsys, monkeypatch, tmp_path):
    from fixtures.make_run import make_run

    run = make_run(tmp_path, configs=("baseline", "kernel"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = cli(capsys, monkeypatch, "report", run, "--out", blocker / "report")
    one_line_error(code, err, "--out", "cannot write there")


def test_unreadable_input_is_one_line(capsys, monkeypatch, tmp_path):
    code, _, err = cli(capsys, monkeypatch, "report", tmp_path / "missing-run")
    one_line_error(code, err, "missing-run")


# ---------------------------------------------------------------- 5. torn last line

def test_drop_torn_tail_cuts_only_the_last_partial_record(tmp_path):
    f = tmp_path / "samples.jsonl"
    f.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "out')
    assert drop_torn_tail(f) == len('{"a": 3, "out')
    assert read_jsonl(f) == [{"a": 1}, {"a": 2}]
    f.write_bytes(b'{"a": 1}\n' + b"\0" * 64)  # a power loss can leave zeros instead of the data
    assert drop_torn_tail(f) == 64 and f.read_text() == '{"a": 1}\n'
    f.write_text('{"a": 1}\n{"a": 2}')  # whole record, newline lost: kept, newline restored
    assert drop_torn_tail(f) == 0 and f.read_text() == '{"a": 1}\n{"a": 2}\n'
    f.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')  # malformed in the middle: not a torn tail
    assert drop_torn_tail(f) == 0
    with pytest.raises(MoebenchError, match="malformed JSON line"):
        read_jsonl(f)


def test_resume_after_a_torn_write_drops_the_line_and_finishes(model, data, capsys, monkeypatch, tmp_path):
    code, _, err = cli(capsys, monkeypatch, *run_args(model, data, tmp_path, "--run-id", "r", "--repeats", "2"))
    assert code == 0, err
    run = tmp_path / "r"
    trials = (run / "trials.jsonl").read_text().splitlines(keepends=True)
    complete = read_jsonl(run / "samples.jsonl")
    # as after a power loss during trial 1: its record never landed, a sample line is half written
    (run / "trials.jsonl").write_text(trials[0])
    with open(run / "samples.jsonl", "a") as f:
        f.write(json.dumps(complete[-1])[:40])
    code, out, err = cli(capsys, monkeypatch, "run", "--resume", run)
    assert code == 0, err
    assert "dropped a torn last line" in err
    samples = read_jsonl(run / "samples.jsonl")
    assert sorted((s["trial"], s["item_id"]) for s in samples) == sorted((s["trial"], s["item_id"]) for s in complete)
    assert len(read_jsonl(run / "trials.jsonl")) == 2
    assert json.loads((run / "summary.json").read_text())["configs"][0]["trials"] == 2

    # a malformed line that is not the last is damage, not a crash artefact: still an error
    lines = (run / "samples.jsonl").read_text().splitlines(keepends=True)
    (run / "samples.jsonl").write_text(lines[0] + "{oops\n" + "".join(lines[1:]))
    (run / "trials.jsonl").write_text(trials[0])
    code, _, err = cli(capsys, monkeypatch, "run", "--resume", run)
    one_line_error(code, err, "samples.jsonl:2: malformed JSON line")


def test_an_append_that_hits_the_file_size_limit_leaves_no_half_record(tmp_path):
    """`ulimit -f` (or a full disk) mid-append: the error reaches the caller and the file is as before."""
    f = tmp_path / "samples.jsonl"
    f.write_text('{"a": 1}\n')
    script = (
        "import resource, sys\n"
        "from moebench.fileio import append_jsonl\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({f.stat().st_size + 20}, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    append_jsonl({str(f)!r}, {{'output': 'x' * 200}})\n"
        "except OSError as e:\n"
        "    print('error', e.errno)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith("error"), result.stderr
    assert f.read_text() == '{"a": 1}\n'
    append_jsonl(f, {"a": 2})
    assert read_jsonl(f) == [{"a": 1}, {"a": 2}]


# ---------------------------------------------------------------- 6. Ctrl-C

def test_ctrl_c_reports_the_complete_trials_kept(model, tmp_path):
    data = write_data(tmp_path / "data", 48)
    out = tmp_path / "results"
    cmd = [sys.executable, "-c", "from moebench.cli.app import main; main()",
           *run_args(model, data, out, "--run-id", "r", "--repeats", "40", "--max-new-tokens", "24")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=interruptible)
    trials = out / "r" / "trials.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if trials.exists() and len(trials.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    kept = len(read_jsonl(trials))
    line = next(line for line in err.splitlines() if line.startswith("interrupted:"))
    assert f"interrupted: {kept} of 40 trials complete and kept in" in line
    assert "samples kept" not in line and "moebench run --resume" in line


# ---------------------------------------------------------------- 8. output a person reads

def test_run_table_is_whole_when_stdout_is_not_a_terminal(capsys, monkeypatch, tmp_path):
    from fixtures.make_run import make_run
    from moebench.measuring.measure import print_summary
    from moebench.results.summary import build_summary

    monkeypatch.delenv("COLUMNS", raising=False)
    summary = build_summary(make_run(tmp_path, configs=("baseline", "kernel", "kernel+scheduler", "all")))
    print_summary(summary, tmp_path)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "kernel+scheduler" in line]
    assert len(rows) == 1, out
    assert rows[0].rstrip().rstrip("│|").rstrip().endswith("ok"), rows[0]  # the last column on the same line
    assert "…" not in out


def test_train_bundled_does_not_default_to_the_installed_model(tmp_path):
    import moebench
    from moebench.cli.app import build_command
    from moebench.cli.train import DEFAULT_OUTS

    option = next(p for p in build_command().commands["train-bundled"].params if p.name == "out")
    assert option.default is None  # each --level then picks its own folder from DEFAULT_OUTS
    package = Path(moebench.__file__).resolve().parent
    for out in DEFAULT_OUTS.values():
        default = out.resolve()
        assert package not in default.parents and default != package, default
