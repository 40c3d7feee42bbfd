"""A prompt that cannot fit the model's context is refused before any trial:
the run used to feed it anyway, score the garbage as wrong answers and exit 0."""

import os
import subprocess
import sys

from repo_paths import REPO

BUNDLED = REPO / "harness" / "bundled" / "gsm-synth-moe"


def _moebench(*args, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "moebench", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _longest(suite_name: str, num_fewshot: int, limit: int, data=None) -> int:
    """The longest prompt in tokens, counted here as the engine counts them."""
    from tokenizers import Tokenizer

    from moebench.suites import load_suite

    suite = load_suite(suite_name, data, limit, num_fewshot=num_fewshot)
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    return max(len(tok.encode(suite.prompt(item)).ids) for item in suite.items)


def test_few_shot_prompts_beyond_the_context_are_refused_and_leave_no_folder(tmp_path):
    longest = _longest("gsm-synth", 8, 6)
    assert longest + 256 > 512  # the bundled model's context: this workload cannot fit
    out = tmp_path / "results"
    r = _moebench("run", "--num-fewshot", 8, "--limit", 6, "--out", out)
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "suite gsm-synth on model gsm-synth-moe" in line
    assert f"has {longest} tokens" in line and "context of 512 tokens" in line
    assert "Traceback" not in r.stderr
    assert not out.exists() or not any(out.iterdir())  # no run folder, nothing to resume


def test_gsm8k_five_shot_on_the_bundled_model_is_refused(tmp_path, gsm8k_dir):
    longest = _longest("gsm8k", 5, 5, gsm8k_dir)
    r = _moebench("run", "--suite", "gsm8k", "--data", gsm8k_dir, "--limit", 5, "--kernel", "fused",
                  "--out", tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"has {longest} tokens" in r.stderr and "suite gsm8k on model gsm-synth-moe" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_prompts_that_fit_run(tmp_path):
    # the same suite with fewer shots and a short limit fits and runs to the end
    r = _moebench("run", "--num-fewshot", 2, "--limit", 2, "--max-new-tokens", 8, "--warmup", 0,
                  "--out", tmp_path, "--run-id", "fits")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "fits" / "summary.json").exists()


def test_a_server_reporting_a_short_context_is_refused_before_any_trial(tmp_path):
    from moebench.serve.app import ServeProcess

    longest = _longest("gsm-synth", 0, 3)
    max_len = longest + 10  # the prompts fit, the 64 new tokens do not
    with ServeProcess(["--threads", "1", "--max-model-len", str(max_len)]) as server:
        # the OpenAI SDK's form of the URL, ending in /v1, is the same server
        r = _moebench("run", "--engine", "openai", "--base-url", server.url + "/v1", "--tokenizer", BUNDLED,
                      "--limit", 3, "--max-new-tokens", 64, "--warmup", 3, "--out", tmp_path / "r")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"context of {max_len} tokens" in r.stderr and f"has {longest} tokens" in r.stderr
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_llama_server_s_slot_context_is_read_and_enforced(tmp_path, llama_server):
    """llama-server states its slot's context (n_ctx in /v1/models' meta and /props): 5-shot prompts
    plus 256 new tokens beyond it are refused before any trial."""
    import socket
    import time

    import httpx

    from moebench.backends.llamacpp import bundled_gguf_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(llama_server), "-m", str(bundled_gguf_path()), "--host", "127.0.0.1", "--port",
                               str(port), "-c", "1024", "-np", "2", "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        n_ctx = httpx.get(url + "/props").json()["default_generation_settings"]["n_ctx"]
        longest = _longest("gsm-synth", 5, 4)
        assert longest + 256 > n_ctx
        r = _moebench("run", "--engine", "openai", "--base-url", url, "--tokenizer", BUNDLED, "--num-fewshot", 5,
                      "--limit", 4, "--warmup", 4, "--out", tmp_path / "r")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"context of {n_ctx} tokens" in r.stderr and f"has {longest} tokens" in r.stderr
