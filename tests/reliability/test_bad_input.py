"""Bad input gives one clear line naming the file and the problem, exit code 2, no traceback."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from moebench.cli.app import main
from tiny_models import make_tiny_checkpoint, write_char_tokenizer


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("good"), "qwen3_e5_k1")
    return write_char_tokenizer(path)


@pytest.fixture
def model_copy(good_model, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(good_model, dst)
    return dst


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    row = {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}
    (d / "test.jsonl").write_text(json.dumps(row) + "\n")
    (d / "train.jsonl").write_text(json.dumps(row) + "\n")
    return d


def run_cli(capsys, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["moebench", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    return exc.value.code, err


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert str(needle) in lines[0], lines[0]


def run_model(capsys, monkeypatch, model, data_dir, tmp_path):
    return run_cli(capsys, monkeypatch, "run", "--model", model, "--suite", "gsm8k", "--data", data_dir,
                   "--num-fewshot", "0", "--max-new-tokens", "4", "--warmup", "0", "--out", tmp_path / "results")


def test_missing_model_directory(capsys, monkeypatch, data_dir, tmp_path):
    code, err = run_model(capsys, monkeypatch, tmp_path / "nope", data_dir, tmp_path)
    assert_one_line_error(code, err, tmp_path / "nope", "not a directory")


def test_unknown_model_type(capsys, monkeypatch, model_copy, data_dir, tmp_path):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    code, err = run_model(capsys, monkeypatch, model_copy, data_dir, tmp_path)
    assert_one_line_error(code, err, "config.json", "unknown model_type 'llama'")


def test_missing_tensor(capsys, monkeypatch, model_copy, data_dir, tmp_path):
    f = model_copy / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    code, err = run_model(capsys, monkeypatch, model_copy, data_dir, tmp_path)
    assert_one_line_error(code, err, "missing tensor", "experts.3.up_proj")


def test_misshaped_tensor(capsys, monkeypatch, model_copy, data_dir, tmp_path):
    f = model_copy / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(7, 40)
    save_file(tensors, f, metadata={"format": "pt"})
    code, err = run_model(capsys, monkeypatch, model_copy, data_dir, tmp_path)
    assert_one_line_error(code, err, "model.safetensors", "q_proj.weight", "shape [7, 40]")


def test_truncated_safetensors(capsys, monkeypatch, model_copy, data_dir, tmp_path):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, err = run_model(capsys, monkeypatch, model_copy, data_dir, tmp_path)
    assert_one_line_error(code, err, "model.safetensors")


def test_malformed_jsonl_line(capsys, monkeypatch, good_model, data_dir, tmp_path):
    with open(data_dir / "test.jsonl", "a") as f:
        f.write('{"question": "broken\n')
    code, err = run_model(capsys, monkeypatch, good_model, data_dir, tmp_path)
    assert_one_line_error(code, err, "test.jsonl:2")


def test_empty_suite(capsys, monkeypatch, good_model, data_dir, tmp_path):
    (data_dir / "test.jsonl").write_text("")
    code, err = run_model(capsys, monkeypatch, good_model, data_dir, tmp_path)
    assert_one_line_error(code, err, "test.jsonl")


def test_unknown_switch_value(capsys, monkeypatch, good_model, data_dir, tmp_path):
    code, err = run_cli(capsys, monkeypatch, "run", "--model", good_model, "--kernel", "turbo")
    assert_one_line_error(code, err, "unknown kernel 'turbo'")


def test_run_writes_valid_results(capsys, monkeypatch, good_model, data_dir, tmp_path):
    monkeypatch.setattr(sys, "argv", ["moebench", "run", "--model", str(good_model), "--suite", "gsm8k",
                                      "--data", str(data_dir), "--num-fewshot", "0", "--max-new-tokens", "6",
                                      "--warmup", "1", "--out", str(tmp_path / "results"), "--run-id", "r"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code in (0, None)
    run_dir = tmp_path / "results" / "r"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["schema"] == "moebench.summary/1"
    (config,) = summary["configs"]
    assert config["name"] == "baseline" and config["activation"]["ok"]
    assert config["accuracy"]["total"] == 1
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["output_tokens"] >= 1 and sample["finish_reason"] in ("stop", "length")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["model"]["model_type"] == "qwen3_moe" and manifest["suite"]["name"] == "gsm8k"
    from moebench.kernels import fused_backend
    from moebench.kernels.cpu_attention import decode_attention_backend

    runtime = manifest["runtime"]  # which implementations ran, as this process would choose them
    assert runtime["fused_moe_backend"] == fused_backend("cpu")
    assert runtime["decode_attention"] == decode_attention_backend("cpu", torch.float32)
    assert isinstance(runtime["huge_page_bytes"], int)


def test_a_budget_refused_when_the_store_is_built_leaves_no_run_folder(capsys, monkeypatch, data_dir, tmp_path):
    """The disk tier's read buffers come out of the budget, so a budget can pass the early checks
    and still be refused when the store is built, after the manifest is written: the run folder,
    which then holds no trial, must not be left behind."""
    out = tmp_path / "results"
    code, err = run_cli(capsys, monkeypatch, "run", "--ablate", "--expert-budget", "0.26", "--offload-tier", "disk",
                        "--limit", "2", "--repeats", "1", "--warmup", "0", "--out", out, "--run-id", "refused")
    # the progress display had started: the error is its last line
    assert code == 2 and "Traceback" not in err, err
    assert "moebench: error: --expert-budget 0.26" in err.splitlines()[-1] and "read buffers" in err
    assert not (out / "refused").exists()
