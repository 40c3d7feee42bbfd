"""The bundled model of the hard level (gsm-synth-hard-moe): its files, its record of how it was
trained, the runtime serving it as the suite's default, and a greedy spot check; `train-bundled
--level` refusing bad input in one line."""

import json
import sys

import pytest
import torch
from safetensors import safe_open

from moebench.cli.app import main
from moebench.models.bundled import BUNDLED_HARD_MODEL, bundled_model_path

present = pytest.mark.skipif(not (BUNDLED_HARD_MODEL / "model.safetensors").exists(),
                             reason="hard level's bundled checkpoint not present")
SPOT_ITEMS = 48
SPOT_MIN_CORRECT = 5  # 9/48 measured (greedy, fused kernel); the easy model or a broken load gets 0-1


def cli_error(capsys, monkeypatch, *args) -> str:
    monkeypatch.setattr(sys, "argv", ["moebench", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_suite_picks_its_own_bundled_model():
    assert bundled_model_path("gsm-synth-hard") == BUNDLED_HARD_MODEL
    assert bundled_model_path("gsm-synth") != BUNDLED_HARD_MODEL
    assert bundled_model_path() == bundled_model_path("gsm-synth")


@present
def test_checkpoint_is_a_small_qwen3_moe_in_bf16():
    cfg = json.loads((BUNDLED_HARD_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg.get("num_experts", cfg.get("num_local_experts")) >= 16 and cfg["num_experts_per_tok"] >= 2
    assert (BUNDLED_HARD_MODEL / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    with safe_open(str(BUNDLED_HARD_MODEL / "model.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    assert "gsm-synth-hard" in (BUNDLED_HARD_MODEL / "README.md").read_text()


@present
def test_training_record_says_how_to_reproduce_it():
    r = json.loads((BUNDLED_HARD_MODEL / "train_result.json").read_text())
    assert r["level"] == "hard" and r["suite"] == "gsm-synth-hard"
    assert r["command"].startswith("moebench train-bundled --level hard ")
    for flag, key in (("--seed", "seed"), ("--batch-size", "batch_size")):
        assert f"{flag} {r[key]} " in r["command"] + " "
    assert r["steps"] > 0 and "synth_hard.iter_problems('train'" in r["data"]
    if "init_from" in r:  # a warm start names the bundle it started from, by content
        assert len(r["init_sha256"]) == 64
    assert r["test_items"] == 1319


@present
def test_runtime_loads_it_and_greedy_spot_check():
    from moebench.engine import Engine, RuntimeConfig, load_checkpoint
    from moebench.engine.loader import load_tokenizer
    from moebench.engine.sequence import Request
    from moebench.suites import load_suite

    torch.set_num_threads(1)
    ckpt = load_checkpoint(BUNDLED_HARD_MODEL, dtype=torch.float32)
    tokenizer = load_tokenizer(BUNDLED_HARD_MODEL)
    suite = load_suite("gsm-synth-hard", limit=SPOT_ITEMS)
    engine = Engine(ckpt, tokenizer, RuntimeConfig(kernel="fused", batch_size=16, max_new_tokens=256))
    result = engine.generate([Request(it.id, suite.prompt(it), stop=tuple(suite.stop)) for it in suite.items])
    texts = {c.id: c.text for c in result.completions}
    correct = sum(suite.score(texts[it.id], it).correct for it in suite.items)
    assert correct >= SPOT_MIN_CORRECT, f"{correct}/{SPOT_ITEMS}"


def test_train_bundled_refuses_bad_level_and_start(capsys, monkeypatch, tmp_path):
    line = cli_error(capsys, monkeypatch, "train-bundled", "--level", "medium", "--out", tmp_path / "o")
    assert "--level 'medium'" in line and "easy" in line and "hard" in line
    line = cli_error(capsys, monkeypatch, "train-bundled", "--level", "hard", "--init-from", tmp_path, "--out", tmp_path / "o")
    assert "--init-from" in line and "model.safetensors" in line
