"""`moebench kernels bench` and `tune` (the command functions, without the main CLI)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from moebench.errors import MoebenchError
from moebench.cli.kernels import SHAPES, _fit_experts, app

runner = CliRunner()


def test_bench_small_custom_shape(tmp_path):
    out = tmp_path / "bench.json"
    result = runner.invoke(
        app,
        ["bench", "--shape", "experts=16,top_k=2,hidden=64,inter=32", "--tokens", "1,5", "--repeats", "2",
         "--json", str(out)],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "speedup" in result.output and "E16k2H64I32" in result.output
    data = json.loads(out.read_text())
    assert [r["tokens"] for r in data["rows"]] == [1, 5]
    assert data["info"]["read_bandwidth_gb_s"] > 0
    for row in data["rows"]:
        assert row["naive_ms"] > 0 and row["fused_ms"] > 0 and 1 <= row["distinct_experts"] <= 16


@pytest.mark.parametrize("args", [["--tokens", "1,x"], ["--tokens", "0"], ["--shape", "nope"],
                                  ["--shape", "experts=4,top_k=8,hidden=8,inter=8"], ["--dtype", "int8"],
                                  ["--device", "tpu"]])
def test_bench_rejects_bad_options(args):
    result = runner.invoke(app, ["bench", *args, "--repeats", "1"])
    assert isinstance(result.exception, MoebenchError), result.output


def test_scaling_down_experts_keeps_groups():
    ling = SHAPES["ling-3.0-flash"]
    per = ling.expert_bytes(4)
    assert _fit_experts(ling, 4, 10**15) == 512
    fit = _fit_experts(ling, 4, 300 * per + 1)
    assert fit == 296 and fit % ling.n_group == 0
    with pytest.raises(MoebenchError):
        _fit_experts(ling, 4, per)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: tuning would run")
def test_tune_refuses_without_gpu():
    result = runner.invoke(app, ["tune", "--quick"])
    assert isinstance(result.exception, MoebenchError)
    assert "CUDA GPU" in str(result.exception)
    result = runner.invoke(app, ["tune", "--device", "cpu"])
    assert isinstance(result.exception, MoebenchError)
