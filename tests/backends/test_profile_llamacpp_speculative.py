"""llama.cpp's n-gram lookup speculative decoding on a real llama-server (issue 32, item 4): the
shipped profile's evidence passes a run's warm-up against the baseline's own server, and the same
configuration with a lookup window no gsm-synth context can match (the flag accepted, the slot
speculative, no draft ever made) is refused at warm-up by the server's own draft counters.

Needs llama-server (the `llama_server` fixture builds it on first use; see docs/engines.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from repo_paths import REPO

PROFILE_FILE = REPO / "profiles" / "llamacpp-speculative-cpu.toml"


def _run(tmp_path, profiles: Path, *args):
    return subprocess.run(
        [sys.executable, "-m", "moebench", "run", "--engine", "openai", "--profiles", str(profiles),
         "--limit", "2", "--warmup", "2", "--max-new-tokens", "48", "--concurrency", "1",
         "--out", str(tmp_path), "--run-id", "r", *args],
        capture_output=True, text=True, timeout=900)


def test_lookup_decoding_drafts_and_is_proven_on_real_servers(llama_server, tmp_path):
    result = _run(tmp_path, PROFILE_FILE)
    assert result.returncode == 0, result.stderr[-2000:]
    log = (tmp_path / "r" / "servers" / "ngram-warmup.log").read_text()
    assert "draft acceptance = " in log


def test_a_lookup_that_never_drafts_is_refused_at_warm_up(llama_server, tmp_path):
    text = PROFILE_FILE.read_text()
    window = '"--spec-ngram-simple-size-n", "2"'
    assert window in text
    profile = tmp_path / "never-drafts.toml"
    profile.write_text(text.replace(window, '"--spec-ngram-simple-size-n", "1024"')
                       .replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    result = _run(tmp_path, profile)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "ngram" in result.stderr and "llamacpp:spec_decode_num_draft_tokens_total is 0.0" in result.stderr
    assert not (tmp_path / "r" / "trials.jsonl").exists()  # stopped before any trial was measured
