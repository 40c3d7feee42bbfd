"""Discrimination with a real llama-server, one started per configuration: the
shipped llama.cpp profile's evidence passes a run's warm-up, every configuration's against the
baseline's own server; a profile whose evidence also holds for the baseline's server is refused
in one line, at warm-up.

Needs llama-server (the `llama_server` fixture builds it on first use; see docs/engines.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from repo_paths import REPO

PROFILE_FILE = REPO / "profiles" / "llamacpp-cpu.toml"


def _run(tmp_path, profiles: Path, *args):
    return subprocess.run(
        [sys.executable, "-m", "moebench", "run", "--engine", "openai", "--profiles", str(profiles),
         "--limit", "2", "--warmup", "2", "--max-new-tokens", "16", "--concurrency", "2",
         "--out", str(tmp_path), "--run-id", "r", *args],
        capture_output=True, text=True, timeout=900)


def test_shipped_profile_discriminates_on_real_servers(llama_server, tmp_path):
    result = _run(tmp_path, PROFILE_FILE)
    assert result.returncode == 0, result.stderr[-2000:]
    servers = sorted(p.name for p in (tmp_path / "r" / "servers").glob("*-warmup.log"))
    assert servers == sorted(f"{name}-warmup.log" for name in
                             ("baseline", "cont-batching", "flash-attn", "stack", "kv-bf16"))


def test_evidence_the_baseline_server_also_shows_is_refused(llama_server, tmp_path):
    """flash-attn's 'n_slots = 1' and total_slots = 1 hold for the one-slot baseline too; without
    their shared = true mark the run stops at warm-up with one line naming the entry."""
    text = PROFILE_FILE.read_text()
    marked = "log_must = ['llama_context: flash_attn\\s+= enabled',\n            { pattern = 'load_model: initializing, n_slots = 1, ', shared = true },"
    assert marked in text
    profile = tmp_path / "unmarked.toml"
    profile.write_text(text.replace(marked, "log_must = ['llama_context: flash_attn\\s+= enabled',\n"
                                            "            'load_model: initializing, n_slots = 1, ',"))
    result = _run(tmp_path, profile, "--profile", "flash-attn")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"moebench: error: {profile}: profile 'flash-attn': evidence log ~ "
                               "'load_model: initializing, n_slots = 1, ' also holds for the baseline 'baseline'")
    # refused at warm-up, before any trial: nothing measured is kept
    assert not (tmp_path / "r").exists()


def test_continuous_batching_switched_off_is_refused_under_the_runs_load(llama_server, tmp_path):
    """`--no-cont-batching` appended to cont-batching (llama.cpp takes the last one): the server
    still has 16 slots, n_seq_max 16 and total_slots 16, the echo of `--parallel 16`, but no prompt
    of a task launched beside a running slot joins it. Where the warm-up's 24 requests overlap, the
    run stops there (exit 2, one line, no trial); where they ran one after another (the join reader:
    not exercised), the trial's 24 concurrent requests fail the evidence (exit 1, the config named).
    Never a pass; the shipped profile under the same load passes."""
    text = PROFILE_FILE.read_text()
    args = 'args = ["--parallel", "16", "--cont-batching", "-fa", "off"]'
    assert text.count(args) == 1
    profile = tmp_path / "no-cont-batching.toml"
    profile.write_text(text.replace(args, args[:-1] + ', "--no-cont-batching"]', 1))
    load = ("--profile", "cont-batching", "--limit", "24", "--warmup", "24", "--concurrency", "24")
    result = _run(tmp_path, profile, *load)
    refusal = "log reader llamacpp_prompts_joining_decoding at_least 1: read 0"
    if result.returncode == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"moebench: error: config 'cont-batching': {refusal}"), lines
        assert not (tmp_path / "r" / "trials.jsonl").exists()
    else:
        assert result.returncode == 1, result.stderr[-2000:]
        # the activation failures are said on stderr (measure's console), the summary table on stdout
        said = " ".join(result.stderr.split())
        assert "activation failed: config 'cont-batching' trial 0:" in said and refusal in said, said[-2000:]
        log = (tmp_path / "r" / "servers" / "cont-batching-t0.log").read_text()
        assert "n_slots = 16" in log and "--no-cont-batching" in log
    good = _run(tmp_path / "on", PROFILE_FILE, *load)
    assert good.returncode == 0, good.stderr[-2000:]
