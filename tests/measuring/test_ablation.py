"""The ablation matrix, and the rule that a switched-on optimization must leave evidence."""

import json
import sys

import pytest

from moebench.ablation import ablation_matrix, config_name
from moebench.cli.app import main
from tiny_models import make_tiny_checkpoint, write_char_tokenizer


def test_matrix_names_and_order():
    names = [c.name for c in ablation_matrix()]
    assert names == ["baseline", "kernel", "scheduler", "prefetch", "kernel+scheduler", "all"]
    assert len(ablation_matrix(factorial=True)) == 8
    assert config_name("fused", "static", "lookahead") == "kernel+prefetch"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_char_tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("m"), "qwen3_e6_k2_norm"))


@pytest.fixture
def data(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}
            for i in range(6)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "test.jsonl").write_text(text)
    (tmp_path / "train.jsonl").write_text(text)
    return tmp_path


def test_ablation_stops_when_an_optimization_leaves_no_evidence(model, data, tmp_path, monkeypatch, capsys):
    import moebench.engine.llm_engine as llm_engine
    from moebench.engine.moe import NaiveMoe

    # a "fused" kernel that silently runs the naive loop: the most common pitfall
    monkeypatch.setattr(llm_engine, "make_kernel", lambda name, overrides=None: NaiveMoe())
    monkeypatch.setattr(sys, "argv", ["moebench", "run", "--model", str(model), "--suite", "gsm8k", "--data", str(data),
                                      "--num-fewshot", "0", "--kernel", "fused", "--max-new-tokens", "4",
                                      "--batch-size", "2", "--out", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "kernel=fused but the fused kernel ran 0 times" in err
    assert not list((tmp_path / "r").glob("*/samples.jsonl"))


def test_one_budget_parser_for_the_matrix_and_the_store():
    """--expert-budget is parsed in one place (engine/config.py): every unit the store sizes a pool by
    is accepted where the run checks its arguments, and a size that is no size is refused there."""
    from moebench.ablation import parse_budget
    from moebench.engine.config import budget_bytes
    from moebench.errors import MoebenchError

    assert parse_budget("0.5") == 0.5 and parse_budget(" 8GB ") == "8GB" and budget_bytes("8GB") == 8e9
    assert budget_bytes(parse_budget("512 KiB")) == 512 * 1024
    for bad in ("abcGB", "8 bytes", "1.5"):
        with pytest.raises(MoebenchError, match="--expert-budget"):
            parse_budget(bad)
