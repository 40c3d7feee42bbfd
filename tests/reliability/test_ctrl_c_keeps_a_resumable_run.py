"""Ctrl-C before the first trial ends keeps the run's folder, so the `moebench run --resume DIR`
it prints works (the folder used to be deleted under the printed command)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from child_signals import interruptible
from tiny_models import make_tiny_checkpoint, write_char_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_char_tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3_e5_k1"))


def _data(directory: Path, items: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"What is {i} + 3?", "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"} for i in range(items)]
    for name in ("test.jsonl", "train.jsonl"):
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _run(model, data, out, *extra):
    return [sys.executable, "-m", "moebench", "run", "--model", str(model), "--suite", "gsm8k", "--data", str(data),
            "--num-fewshot", "0", "--max-new-tokens", "24", "--out", str(out), "--run-id", "r", *map(str, extra)]


def _interrupt_when(proc, ready, timeout_s=240.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted: " + proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # main exits 130; a process ended by SIGINT's default action reads as 130 to a shell as well
    # ($? is 128 + 2), and that is what two clean-clone CI runs saw, rarely, after the interrupted
    # line (docs/reliability.md). The line, the kept folder and the resume below are checked either way.
    assert proc.returncode in (130, -signal.SIGINT), err[-2000:]
    return err


def _lines(f: Path) -> int:
    return len(f.read_text().splitlines()) if f.exists() else 0


ITEMS = 4000


@pytest.mark.parametrize("when", ["first trial", "warm-up"])
def test_ctrl_c_before_the_first_trial_ends_keeps_a_resumable_folder(model, tmp_path, when):
    # 4000 items: on the tiny model a 400-item trial could end before the SIGINT reached it
    data = _data(tmp_path / "data", ITEMS)
    out = tmp_path / "results"
    run_dir = out / "r"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if when == "first trial":
        proc = subprocess.Popen(_run(model, data, out, "--warmup", "0"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=interruptible)
        err = _interrupt_when(proc, lambda: _lines(run_dir / "samples.jsonl") >= 1)
        assert _lines(run_dir / "trials.jsonl") == 0  # stopped inside the first trial
    else:
        proc = subprocess.Popen(_run(model, data, out, "--warmup", "400"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=interruptible)
        err = _interrupt_when(proc, lambda: (run_dir / "manifest.json").exists())
        assert not (run_dir / "samples.jsonl").exists()
    line = next(line for line in err.splitlines() if line.startswith("interrupted"))
    assert f"moebench run --resume {run_dir}" in line
    assert (run_dir / "manifest.json").is_file()

    # the printed command works: the run goes on to the end from the kept folder
    resumed = subprocess.run([sys.executable, "-m", "moebench", "run", "--resume", str(run_dir)],
                             capture_output=True, text=True, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _lines(run_dir / "trials.jsonl") == 1
    assert _lines(run_dir / "samples.jsonl") == ITEMS
