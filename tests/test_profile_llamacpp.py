"""Discrimination with a real llama-server, one started per configuration: the
shipped llama.cpp profile's evidence passes a run's warm-up, every configuration's against the
baseline's own server; a profile whose evidence also holds for the baseline's server is refused
in one line, at warm-up.

Needs llama-server (the `llama_server` fixture builds it on first use; see docs/engines.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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

