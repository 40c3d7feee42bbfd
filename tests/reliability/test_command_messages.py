"""What commands say in the smaller cases, each through the real command: an unreachable server,
a negative warm-up, the kernels bench shape format in --help, long lines kept whole when piped,
lm-eval run outside a repository."""

import json
import os
import socket
import subprocess
import sys


def _moebench(*args, cwd=None, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "moebench", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL, env=env or os.environ)


def test_a_closed_port_says_the_server_is_unreachable(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _moebench("run", "--engine", "openai", "--base-url", f"http://127.0.0.1:{port}/v1", "--limit", 2,
                  "--out", tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert f"http://127.0.0.1:{port}: the server is unreachable" in line and "--served-model" not in line


def test_negative_warmup_is_refused(tmp_path):
    r = _moebench("run", "--warmup", -1, "--limit", 2, "--out", tmp_path)
    assert r.returncode == 2 and "--warmup must be >= 0" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_kernels_bench_help_shows_the_whole_shape_format():
    r = _moebench("kernels", "bench", "--help", env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0
    text = " ".join(line.strip("│ ") for line in r.stdout.splitlines())
    assert "…" not in r.stdout
    assert '"experts=E, top_k=K, hidden=H, inter=I"' in text
    # and the format it shows is one the option accepts
    bench = _moebench("kernels", "bench", "--shape", "experts=8, top_k=2, hidden=16, inter=8", "--tokens", "1",
                      "--repeats", "1", "--threads", "1")
    assert bench.returncode == 0, bench.stderr[-2000:]


def test_piped_output_keeps_long_lines_whole(tmp_path):
    from fixtures.make_run import make_run

    run_dir = make_run(tmp_path / ("results-" + "x" * 60), configs=("baseline", "kernel"))
    out = tmp_path / ("report-" + "y" * 60)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = _moebench("report", run_dir, "--out", out, env=env)  # stdin, stdout and stderr: no terminal
    assert r.returncode == 0, r.stderr[-2000:]
    wrote = [line for line in r.stdout.splitlines() if line.startswith("wrote")]
    assert len(wrote) == 1 and str(out / "report.md") in wrote[0] and wrote[0].endswith("plots"), r.stdout


def test_lm_eval_outside_a_repository_is_quiet_and_starts_at_an_offset(tmp_path):
    from moebench.suites import load_suite

    out = tmp_path / "lm_eval.json"
    r = _moebench("lm-eval", "--tasks", "gsm-synth", "--offset", 3, "--limit", 2, "--num-fewshot", 0,
                  "--max-gen-toks", 16, "--output", out, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "not a git repository" not in r.stderr + r.stdout
    samples = json.loads(out.read_text())["samples"]["gsm_synth"]
    asked = list(dict.fromkeys(s["doc"]["question"] for s in samples))  # one sample per filter
    items = load_suite("gsm-synth", limit=5).items
    assert asked == [items[3].question, items[4].question]
