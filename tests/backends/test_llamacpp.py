"""llama.cpp's real llama-server, built by moebench.backends.llamacpp, on GGUF files written by
`moebench export gguf`: it tokenizes prompts as tokenizer.json does, its greedy completions
(prompts sent as token ids) equal the in-process runtime's token for token, on the bundled
qwen3_moe model and on a random mixtral, and every configuration of profiles/llamacpp-cpu.toml
starts and shows its evidence.

The first run builds llama-server (minutes; cached after, see docs/engines.md). If it cannot be
built the tests fail when CI is set and skip loudly otherwise. Every server is stopped in a
finally (its whole process group), and the tests check that it exited.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from moebench.measuring.run import bundled_model_path
from repo_paths import REPO

PROFILE_FILE = REPO / "profiles" / "llamacpp-cpu.toml"
NEW_TOKENS = 128  # the bundled model's answers to these items end with EOS well before this


@pytest.fixture(scope="module")
def profile_file(llama_server):
    from moebench.backends.profiles import load_profiles

    return load_profiles(PROFILE_FILE)


class _Running:
    """A started ServerProcess, stopped (process group killed) on exit whatever happened."""

    def __init__(self, profile, log: Path, health: str = "/health", timeout_s: float = 300):
        from moebench.backends.server import Placeholders, ServerProcess

        self.server = ServerProcess(profile, Placeholders("127.0.0.1", None, None, 1), log, health, timeout_s)

    def __enter__(self):
        try:
            self.server.start()
        except BaseException:
            self.server.stop()
            raise
        return self.server

    def __exit__(self, *exc):
        self.server.stop()
        assert self.server.exit_code is not None, "llama-server still running after stop()"


def _profile(profile_file, name: str):
    return next(p for p in profile_file.profiles if p.name == name)


@pytest.fixture(scope="module")
def baseline_server(profile_file, tmp_path_factory):
    with _Running(_profile(profile_file, "baseline"), tmp_path_factory.mktemp("llamacpp") / "baseline.log") as server:
        yield server


@pytest.fixture(scope="module")
def suite_and_tokenizer():
    from moebench.engine.loader import load_tokenizer
    from moebench.suites import load_suite

    return load_suite("gsm-synth", limit=200), load_tokenizer(bundled_model_path())


def _greedy_over_http(base_url: str, prompts: list[list[int]], max_tokens: int, concurrency: int = 1) -> list[list[int]]:
    """llama-server's greedy tokens per prompt, the EOS it stopped at left out (as the runtime does)."""
    def one(ids: list[int]) -> list[int]:
        body = httpx.post(base_url + "/completion", timeout=300, json={
            "prompt": ids, "n_predict": max_tokens, "temperature": 0, "return_tokens": True,
            "cache_prompt": False}).json()
        tokens = list(body["tokens"])
        return tokens[:-1] if body.get("stop_type") == "eos" else tokens

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def _in_process_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list:
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.loader import load_tokenizer

    engine = Engine(load_checkpoint(model_dir), load_tokenizer(model_dir),
                    RuntimeConfig(batch_size=len(prompts), max_new_tokens=max_tokens))
    requests = [Request(id=str(i), prompt="") for i in range(len(prompts))]
    return engine.generate(requests, prompt_ids=prompts).completions


def test_gguf_tokenizer_matches_tokenizer_json(baseline_server, suite_and_tokenizer):
    """The 200 default prompts, five-shot prompts (numbers, <<a*b=c>>, ####, blank lines) and odd
    spacing tokenize to the same ids in llama.cpp as in tokenizer.json, and decode back to the text."""
    from moebench.suites import load_suite

    suite, tok = suite_and_tokenizer
    five_shot = load_suite("gsm-synth", limit=8, num_fewshot=5)
    texts = [suite.prompt(item) for item in suite.items] + [five_shot.prompt(item) for item in five_shot.items]
    texts += ["a  b   12 345\n\n  x", "Tom's 3rd cat's 10%  off: $4.50!!", "  leading and trailing  ", "7\t8 \n9"]
    with httpx.Client(base_url=baseline_server.base_url, timeout=30) as client:
        for text in texts:
            got = client.post("/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
            assert got == tok.encode(text).ids, text
            assert client.post("/detokenize", json={"tokens": got}).json()["content"] == text


def test_greedy_completions_equal_in_process_runtime(baseline_server, suite_and_tokenizer):
    suite, tok = suite_and_tokenizer
    items = suite.items[:16]
    prompts = [tok.encode(suite.prompt(item)).ids for item in items]
    expected = _in_process_greedy(bundled_model_path(), prompts, NEW_TOKENS)
    got = _greedy_over_http(baseline_server.base_url, prompts, NEW_TOKENS)
    for item, completion, tokens in zip(items, expected, got):
        assert completion.finish_reason == "stop", f"{item.id}: no EOS within {NEW_TOKENS} tokens"
        assert tokens == completion.output_ids, f"{item.id}: llama.cpp {tok.decode(tokens)!r} vs in-process {completion.text!r}"


@pytest.mark.parametrize("name", ["cont-batching", "flash-attn", "stack", "kv-bf16"])
def test_profile_shows_its_evidence(name, profile_file, suite_and_tokenizer, tmp_path):
    """Each configuration starts, shows its evidence at start and after 16 concurrent requests,
    and the exact ones still give the in-process runtime's greedy tokens (batched and all)."""
    suite, tok = suite_and_tokenizer
    profile = _profile(profile_file, name)
    prompts = [tok.encode(suite.prompt(item)).ids for item in suite.items[16:32]]
    with _Running(profile, tmp_path / f"{name}.log") as server:
        seen, errors = server.evidence("start")
        assert errors == [], seen
        got = _greedy_over_http(server.base_url, prompts, NEW_TOKENS, concurrency=16)
        seen, errors = server.evidence("end")
        assert errors == [], seen
    if not profile.approximate:
        expected = [c.output_ids for c in _in_process_greedy(bundled_model_path(), prompts, NEW_TOKENS)]
        assert got == expected


def test_evidence_catches_a_switch_that_did_not_take(profile_file, tmp_path):
    """The flash-attn configuration's evidence, on a server started with flash attention off: the
    evidence must fail (a switch silently not applied is an activation failure, not a result)."""
    from dataclasses import replace

    flash = _profile(profile_file, "flash-attn")
    off = replace(flash, command=tuple(flash.command) + ("-fa", "off"))  # the last -fa wins in llama.cpp
    with _Running(off, tmp_path / "off.log") as server:
        httpx.post(server.base_url + "/completion", timeout=60, json={"prompt": [51, 85], "n_predict": 4})
        _, errors = server.evidence("end")
    assert any("flash_attn" in e for e in errors), errors


def test_random_mixtral_greedy_equals_in_process(llama_server, tmp_path):
    """A random mixtral (llama.cpp's llama architecture, q/k rows reordered for its RoPE) through
    llama-server: the first greedy tokens equal the runtime's. A random model's next-token logits
    can nearly tie, so float reordering could split a long path; 12 tokens per prompt are compared."""
    from moebench.backends.profiles import Profile
    from moebench.models.export_gguf import export_gguf
    from tiny_models import make_tiny_checkpoint, write_char_tokenizer

    ckpt = write_char_tokenizer(make_tiny_checkpoint(tmp_path / "mx", "mixtral_e5_k2"), 211)
    gguf = export_gguf(ckpt, tmp_path / "mx.gguf")
    prompts = [[5 + (7 * i + j) % 90 for j in range(6 + i)] for i in range(6)]
    new = 12
    expected = [c.output_ids for c in _in_process_greedy(ckpt, prompts, new)]
    argv = (str(llama_server), "-m", str(gguf), "--host", "{host}", "--port", "{port}", "-t", "1",
            "-c", "512", "--parallel", "1", "-fa", "off", "-ctk", "f32", "-ctv", "f32")
    with _Running(Profile("mixtral", argv), tmp_path / "mx.log") as server:
        got = _greedy_over_http(server.base_url, prompts, new)
    assert sum(map(len, expected)) >= len(prompts) * new // 2  # long paths compared, not early EOS
    assert got == expected


def test_missing_toolchain_is_one_line_exit_2(tmp_path):
    """No cmake or compiler on PATH: one line naming what is missing, exit 2, before any download."""
    import subprocess
    import sys

    env = {**os.environ, "PATH": str(tmp_path), "MOEBENCH_CACHE": str(tmp_path / "cache")}
    env.pop("MOEBENCH_LLAMA_SERVER", None)
    env.pop("CC", None)
    env.pop("CXX", None)
    result = subprocess.run([sys.executable, "-m", "moebench", "engines", "build-llamacpp"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cmake" in lines[0] and "C++ compiler" in lines[0], result.stderr
    assert not any((tmp_path / "cache").rglob("*.tar.gz")) and not any((tmp_path / "cache").rglob("llama-server"))


def test_build_is_keyed_on_the_cpu_flags(monkeypatch, tmp_path):
    """A build for an AVX-512 CPU is never picked up on one without AVX-512 (GGML_NATIVE does not
    dispatch at run time), and the same flags find the same build."""
    from moebench.backends import llamacpp

    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path))
    avx2 = ["avx", "avx2", "fma", "sse4_2"]
    monkeypatch.setattr(llamacpp, "cpu_features", lambda: avx2)
    first = llamacpp.build_dir()
    monkeypatch.setattr(llamacpp, "cpu_features", lambda: sorted(avx2 + ["avx512f", "avx512bw"]))
    assert llamacpp.build_dir() != first
    monkeypatch.setattr(llamacpp, "cpu_features", lambda: list(avx2))
    assert llamacpp.build_dir() == first and first.parent == tmp_path / "llama.cpp"
    assert llamacpp.LLAMA_CPP_PYTHON_VERSION in first.name
