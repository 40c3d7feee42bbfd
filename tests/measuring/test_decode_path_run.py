"""The decode path through `moebench run`: the native path runs from the main job (one config, and as
the decode-path ablation axis with a speedup of its own), and a model or config that cannot run it is
refused before the run starts, in one line, exit 2."""

import json
import sys

import pytest

from moebench.cli.app import main
from moebench.engine.overrides import Overrides
from tiny_bailing import make_tiny_bailing
from tiny_models import make_tiny_checkpoint


def run_cli(capsys, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["moebench", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def needs_extension():
    from moebench.engine.model import cpu_step_ops

    if cpu_step_ops() is None:
        pytest.skip("the native decode path needs the C++ extension")


SMALL = ("--limit", "2", "--warmup", "1", "--max-new-tokens", "8")


def test_a_native_run_on_the_bundled_model(capsys, monkeypatch, tmp_path):
    needs_extension()
    code, err = run_cli(capsys, monkeypatch, "run", "--kernel", "fused", "--decode-path", "native", *SMALL,
                        "--out", tmp_path, "--run-id", "r")
    assert code == 0, err
    trial = json.loads((tmp_path / "r" / "trials.jsonl").read_text().splitlines()[0])
    path = trial["evidence"]["decode_path"]
    assert path["path"] == "native" and path["requested"] == "native"
    assert set(path["decode_steps"]) == {"native-layers"} and trial["activation_ok"]
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["runtime"]["overrides"] == Overrides().to_dict()  # read once at the entry, recorded


def test_the_decode_path_axis_gets_its_own_speedup_and_evidence(capsys, monkeypatch, tmp_path):
    needs_extension()
    code, err = run_cli(capsys, monkeypatch, "run", "--ablate", "--axes", "decode-path", "--repeats", "2", *SMALL,
                        "--out", tmp_path, "--run-id", "r")
    assert code == 0, err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    configs = {c["name"]: c for c in summary["configs"]}
    assert list(configs) == ["baseline", "kernel", "decode-path=native"]
    native = configs["decode-path=native"]
    assert native["vs_reference"]["config"] == "kernel" and native["vs_reference"]["speedup"]["median"] > 0
    assert native["vs_baseline"]["identical_outputs"] == 1.0
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["runtime"]["expert_budget"] == 1.0  # the native point needs every expert resident
    paths = {}
    for line in (tmp_path / "r" / "trials.jsonl").read_text().splitlines():
        t = json.loads(line)
        paths[t["config"]] = t["evidence"]["decode_path"]["path"]
    assert paths == {"baseline": "chained", "kernel": "chained", "decode-path=native": "native"}


@pytest.mark.parametrize("args,needle", [
    (("--decode-path", "native"), "it needs kernel=fused and prefetch=off, not kernel=naive"),
    (("--kernel", "fused", "--decode-path", "native", "--prefetch", "lookahead", "--expert-budget", "0.5"),
     "it needs kernel=fused and prefetch=off"),
    (("--kernel", "fused", "--decode-path", "native", "--expert-budget", "0.5"), "leaves experts out of memory"),
    (("--ablate", "--decode-path", "native"), "add decode-path to --axes"),
    (("--ablate", "--axes", "decode-path", "--decode-path", "eager"), "cannot be its reference"),
])
def test_a_config_native_cannot_run_is_one_line(capsys, monkeypatch, tmp_path, args, needle):
    code, err = run_cli(capsys, monkeypatch, "run", *args, *SMALL, "--out", tmp_path, "--run-id", "r")
    assert code == 2 and needle in one_line(err), err
    assert not (tmp_path / "r").exists()  # refused before the run claimed its folder


def test_models_that_cannot_run_native_are_refused_in_one_line(capsys, monkeypatch, tmp_path):
    ling = make_tiny_bailing(tmp_path / "ling")
    dense = make_tiny_checkpoint(tmp_path / "dense", "qwen3_e5_k1", mlp_only_layers=[0])
    capsys.readouterr()  # (transformers' progress bars while writing them)
    for model, path, needle in ((ling, "native", "bailing_hybrid model runs its layers from Python only"),
                                (ling, "chained", "bailing_hybrid model runs its layers from Python only"),
                                (dense, "native", "the model has dense layers (0)")):
        code, err = run_cli(capsys, monkeypatch, "run", "--model", model, "--kernel", "fused", "--decode-path", path,
                            *SMALL, "--out", tmp_path / "out")
        line = one_line(err)
        assert code == 2 and needle in line and f"decode path '{path}' cannot run" in line, err


def test_a_batch_the_step_ops_do_not_take_is_counted_as_such():
    """A decode step of more rows than the step ops stream runs the ops one by one; the runner counts
    it under its own name, so the evidence never says chained (or native) for a step that was not."""
    import torch

    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.runner import LAYER_BY_LAYER, NATIVE, OVER_ROWS, STEP_OP_MAX_ROWS
    from moebench.measuring.run import bundled_model_path

    needs_extension()
    ckpt = load_checkpoint(bundled_model_path(), dtype=torch.float32, experts_in_checkpoint_dtype=True)
    n = STEP_OP_MAX_ROWS + 4
    requests = [Request(f"r{i}", "", 3) for i in range(n)]
    prompts = [[5 + i % 7, 6, 7] for i in range(n)]
    for path, kind in (("chained", LAYER_BY_LAYER), ("native", NATIVE)):
        rt = RuntimeConfig(kernel="fused", decode_path=path, batch_size=n, max_new_tokens=3)
        result = Engine(ckpt, None, rt).generate(requests, prompt_ids=prompts)
        steps = result.evidence["decode_path"]["decode_steps"]
        assert steps.get(OVER_ROWS, 0) > 0 and kind not in steps, (path, steps)
        assert result.evidence["decode_path"]["path"] == path
        if path == "native":  # no decode step ran in one call: that is an activation error, not a result
            assert any("no decode step ran in one native call" in e for e in result.activation_errors)
