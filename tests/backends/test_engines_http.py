"""`moebench run --engine openai` against real servers that moebench starts (`moebench serve`
from a profile file): the same files and statistics as in-process, evidence from the server,
a server killed mid-run, and no process left behind."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from repo_paths import REPO

ITEMS = 6
MAX_NEW = 48


def _profile(path: Path, profiles: str, **server) -> Path:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in server.items())
    path.write_text(textwrap.dedent(f"""
        [server]
        command = ["{{python}}", "-m", "moebench", "serve", "--host", "{{host}}", "--port", "{{port}}",
                   "--threads", "1", "--max-new-tokens", "{MAX_NEW}"]
        health = "/health"
        startup_timeout_s = 240
        tokenizer = "{{bundled_model}}"
    """) + extra + textwrap.dedent(profiles))
    return path


TWO_PROFILES = """
    [[profile]]
    name = "static"
    args = ["--scheduler", "static", "--kernel", "naive"]
    [profile.evidence]
    [[profile.evidence.endpoint]]
    path = "/health"
    field = "status"
    matches = "ok"

    [[profile]]
    name = "fused"
    args = ["--scheduler", "continuous", "--kernel", "fused"]
    [profile.evidence]
    log_must_not = ['Traceback']
    [[profile.evidence.endpoint]]
    path = "/v1/moebench/evidence"
    field = "evidence.kernel.fused_calls"
    at_least = 1
    when = "end"
    kind = "runtime"                  # a counter only the fused kernel moves
"""


def _moebench(*args, timeout=900, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "moebench", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def _serve_processes(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (a port or a run dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker in cmd and "serve" in cmd and state != "Z":
            pids.append(int(proc.name))
    return pids


def _samples(run_dir: Path) -> list[dict]:
    f = run_dir / "samples.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("inproc")
    r = _moebench("run", "--limit", ITEMS, "--max-new-tokens", MAX_NEW, "--warmup", "0", "--out", out,
                  "--run-id", "ref")
    assert r.returncode == 0, r.stderr[-2000:]
    return {s["item_id"]: s["output"] for s in _samples(out / "ref")}


def test_profiles_run_matches_in_process_and_leaves_no_server(tmp_path, in_process):
    profiles = _profile(tmp_path / "serve.toml", TWO_PROFILES)
    out = tmp_path / "results"
    r = _moebench("run", "--engine", "openai", "--profiles", profiles, "--limit", ITEMS, "--max-new-tokens", MAX_NEW,
                  "--repeats", "2", "--warmup", "2", "--concurrency", "4", "--out", out, "--run-id", "http")
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = out / "http"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [c["name"] for c in summary["configs"]] == ["static", "fused"]
    fused = summary["configs"][1]
    assert fused["activation"]["ok"] is True
    trials = [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    seen = [t["evidence"]["seen"] for t in trials if t["config"] == "fused"]
    assert all(s["/v1/moebench/evidence evidence.kernel.fused_calls at_least 1"] >= 1 for s in seen)
    assert fused["vs_baseline"]["identical_outputs"] == 1.0
    assert fused["decode_tokens_per_s"]["median"] > 0
    samples = _samples(run_dir)
    assert len(samples) == 2 * 2 * ITEMS and all(s["error"] is None for s in samples)
    # prompts went as token ids through the server: greedy outputs equal the in-process runtime's
    for s in samples:
        assert s["output"] == in_process[s["item_id"]], s["item_id"]
        assert s["ttft_s"] > 0 and s["output_tokens"] >= 1
    # each (config, trial) had its own server, whose own log is kept beside the results
    logs = sorted(p.name for p in (run_dir / "servers").glob("*.log"))
    assert "fused-t1.log" in logs and "static-warmup.log" in logs
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["engine"]["engine"] == "openai" and manifest["engine"]["prompt_as"] == "token_ids"
    assert not _serve_processes(str(tmp_path))
    assert not _serve_processes("moebench serve --host 127.0.0.1")


def test_missing_evidence_fails_before_any_trial(tmp_path):
    profiles = _profile(tmp_path / "serve.toml", """
        [[profile]]
        name = "base"
        [profile.evidence]
        log_must_not = ['Traceback']

        [[profile]]
        name = "claims-a-kernel"
        args = ["--kernel", "naive"]
        [profile.evidence]
        log_must = ['this switch was never on']
    """)
    out = tmp_path / "results"
    r = _moebench("run", "--engine", "openai", "--profiles", profiles, "--limit", 2, "--max-new-tokens", 8,
                  "--warmup", "1", "--out", out, "--run-id", "x")
    assert r.returncode == 2
    assert "claims-a-kernel" in r.stderr and "never on" in r.stderr
    assert not (out / "x" / "samples.jsonl").exists()


def test_server_killed_mid_run_keeps_samples_and_fails(tmp_path):
    profiles = _profile(tmp_path / "serve.toml", """
        [[profile]]
        name = "only"
        args = ["--scheduler", "static", "--batch-size", "1"]
        [profile.evidence]
        log_must_not = ['Traceback']
    """)
    out = tmp_path / "results"
    run_dir = out / "killed"
    cmd = [sys.executable, "-m", "moebench", "run", "--engine", "openai", "--profiles", str(profiles),
           "--limit", "40", "--max-new-tokens", str(MAX_NEW), "--warmup", "0", "--concurrency", "1",
           "--out", str(out), "--run-id", "killed"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while len(_samples(run_dir)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(_samples(run_dir)) >= 3, proc.stderr.read() if proc.poll() is not None else "too slow"
        log = next((run_dir / "servers").glob("only-t0.log")).read_text()
        port = re.search(r"--port (\d+)", log).group(1)
        victims = _serve_processes(f"--port {port}")
        assert victims
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert "exited with code" in err and "samples so far are kept" in err
    samples = _samples(run_dir)
    ok = [s for s in samples if s["error"] is None]
    failed = [s for s in samples if s["error"] is not None]
    assert len(ok) >= 3 and failed, "the completed samples are kept and the failures are recorded per request"
    assert all(s["finish_reason"] == "error" for s in failed)
    assert not _serve_processes(f"--port {port}")


def test_base_url_drives_a_running_server(tmp_path, in_process):
    from moebench.serve.app import ServeProcess

    bundled = REPO / "harness" / "bundled" / "gsm-synth-moe"
    with ServeProcess(["--threads", "1"]) as server:
        r = _moebench("run", "--engine", "openai", "--base-url", server.url, "--tokenizer", bundled, "--limit", 3,
                      "--max-new-tokens", MAX_NEW, "--warmup", "0", "--out", tmp_path / "r", "--run-id", "b")
    assert r.returncode == 0, r.stderr[-2000:]
    samples = _samples(tmp_path / "r" / "b")
    assert len(samples) == 3
    for s in samples:
        assert s["output"] == in_process[s["item_id"]]
