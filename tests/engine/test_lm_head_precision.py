"""The LM head in low precision (--lm-head bf16 / int8 / fp8): the kernel against the torch reference,
the quantizer, the engine's evidence, and the ablation axis."""

import json
import sys

import pytest
import torch

from moebench.ablation import ablation_matrix, parse_axes
from moebench.engine.quantize import FP8_E4M3_MAX, quantize_lm_head
from moebench.errors import MoebenchError
from moebench.kernels.cpu_moe import load_extension
from moebench.kernels.reference import lm_head_reference

ext = load_extension()
needs_ext = pytest.mark.skipif(ext is None or not hasattr(ext, "lm_head_linear"), reason="the C++ extension did not build")

# rows (vocab) not a multiple of the 4-row groups or the 64-row items, columns (hidden) not a
# multiple of the 8-wide vectors, and token counts on both sides of the streamed / tiled split (3)
SHAPES = [(1, 8, 1), (7, 13, 2), (64, 64, 3), (100, 96, 4), (257, 200, 5), (1000, 1027, 16), (766, 192, 1), (130, 40, 32)]


def _head(rows, cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3  # rows of unequal range
    return quantize_lm_head(w, dtype)


def _bound(x, w, scale):
    """A float32 rounding bound for x @ (w * scale).T summed in any order."""
    mag = x.abs().float() @ w.float().abs().T
    if scale is not None:
        mag = mag * scale
    return 1e-5 * x.shape[1] ** 0.5 * mag + 1e-6


@needs_ext
@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("rows,cols,tokens", SHAPES)
def test_kernel_matches_the_torch_reference(dtype, rows, cols, tokens):
    w, scale = _head(rows, cols, dtype, seed=rows * 31 + cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    got = ext.lm_head_linear(x, w, scale)
    want = lm_head_reference(x, w, scale)
    assert got.dtype == torch.float32 and got.shape == (tokens, rows)
    assert ((got - want).abs() <= _bound(x, w, scale)).all(), (got - want).abs().max()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_every_stored_value_is_widened_exactly(dtype):
    """Each of the format's byte patterns (fp8: but its two NaNs) as one row's weights, read against
    one-hot tokens: the kernel's value of every byte is torch's, subnormals and signs included."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if dtype == torch.float8_e4m3fn:
        codes = codes[(codes & 0x7F) != 0x7F]
    values = codes.view(dtype)
    k = values.numel()
    w = values.view(1, k).expand(5, k).contiguous()  # a group of four rows and one left over
    scale = torch.tensor([1.0, 0.5, 3.0, 2.0**-7, 1e3])
    eye = torch.eye(k)
    want = values.float()[:, None] * scale
    # all at once (the tiled loop, 4+ tokens), and three at a time (the streamed loop)
    assert torch.equal(ext.lm_head_linear(eye, w, scale), want)
    for t in range(0, k, 3):
        assert torch.equal(ext.lm_head_linear(eye[t : t + 3], w, scale), want[t : t + 3])


@needs_ext
def test_rows_beyond_a_decode_step_run_the_reference_and_are_counted_as_torch():
    from moebench.kernels import cpu_dense

    w, scale = _head(300, 64, "int8", seed=5)
    x = torch.randn(cpu_dense.DENSE_MAX_ROWS + 8, 64)  # a prefill's rows (every position)
    before, kernel_before = cpu_dense.lm_head_stats_torch().get("int8", 0), ext.lm_head_stats()["int8"]
    assert torch.equal(cpu_dense.lm_head(x, w, scale), lm_head_reference(x, w, scale))
    assert cpu_dense.lm_head_stats_torch()["int8"] == before + 1
    assert ext.lm_head_stats()["int8"] == kernel_before
    few = x[:4]
    assert ((cpu_dense.lm_head(few, w, scale) - lm_head_reference(few, w, scale)).abs() <= _bound(few, w, scale)).all()
    # counted where it ran: the int8 weights and a float32 scale per row
    assert ext.lm_head_stats()["int8"] == {"calls": kernel_before["calls"] + 1,
                                           "bytes": kernel_before["bytes"] + 300 * 64 + 4 * 300}
    assert cpu_dense.lm_head_stats_torch()["int8"] == before + 1


def test_quantizer_keeps_each_row_within_its_format():
    w = torch.randn(50, 70) * torch.linspace(0.01, 10, 50)[:, None]
    w[3] = 0  # an all-zero row
    q, scale = quantize_lm_head(w, "int8")
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale[3] == 1
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    f, fscale = quantize_lm_head(w, "fp8")
    assert f.dtype == torch.float8_e4m3fn and not torch.isnan(f.float()).any()
    assert torch.allclose(f.float().abs().amax(dim=1)[[0, 10, 49]], torch.tensor(FP8_E4M3_MAX))
    rel = (f.float() * fscale[:, None] - w).abs() / w.abs().clamp_min(fscale[:, None] * 2**-6)
    assert rel.max() <= 2**-4 + 1e-6  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative
    b, none = quantize_lm_head(w, "bf16")
    assert b.dtype == torch.bfloat16 and none is None
    assert quantize_lm_head(w, "f32")[0] is w
    with pytest.raises(MoebenchError):
        quantize_lm_head(w, "int4")


# ------------------------------------------------------------------ the engine


def _bundled(limit):
    from moebench.engine import load_checkpoint
    from moebench.engine.loader import load_tokenizer
    from moebench.measuring.run import bundled_model_path
    from moebench.suites import load_suite

    path = bundled_model_path()
    suite = load_suite("gsm-synth", limit=limit)
    return load_checkpoint(path, dtype=torch.float32), load_tokenizer(path), suite


def _generate(ckpt, tokenizer, suite, **runtime):
    from moebench.engine import Engine, Request, RuntimeConfig

    engine = Engine(ckpt, tokenizer, RuntimeConfig(**runtime))
    return engine.generate([Request(item.id, suite.prompt(item), None, tuple(suite.stop)) for item in suite.items])


@needs_ext
def test_engine_with_an_int8_head_streams_int8_and_says_so():
    ckpt, tokenizer, suite = _bundled(6)
    vocab, hidden = ckpt.lm_head.shape
    outputs = {}
    # the layer-by-layer path (auto) and the whole step in one native call (DecodeLayers)
    for path, steps_key in (("auto", "layer-by-layer"), ("native", "native-layers")):
        result = _generate(ckpt, tokenizer, suite, kernel="fused", batch_size=3, max_new_tokens=24, lm_head="int8",
                           decode_path=path)
        assert not result.activation_errors
        head = result.evidence["lm_head"]
        assert head["precision"] == "int8" and set(head["kernel"]) == {"int8"} and not head["torch"]
        calls = head["kernel"]["int8"]["calls"]
        # one call per step (a prefill's last tokens are few rows too)
        assert calls == len(result.steps)
        assert head["kernel"]["int8"]["bytes"] == calls * (vocab * hidden + 4 * vocab)
        assert result.evidence["decode_steps"].get(steps_key, 0) > 0
        outputs[path] = [c.output_ids for c in result.completions]
    assert outputs["auto"] == outputs["native"]  # one kernel, one order of sums, on either path
    # the checkpoint's own head is untouched (tied to the embeddings here)
    assert ckpt.lm_head.dtype == torch.float32


@needs_ext
def test_an_lm_head_config_whose_kernel_streamed_float32_is_an_activation_error():
    from moebench.engine.model import lm_head_errors

    ckpt, tokenizer, suite = _bundled(2)
    full = _generate(ckpt, tokenizer, suite, batch_size=2, max_new_tokens=4)
    evidence = dict(full.evidence["lm_head"], precision="int8")  # what an int8 config would see had f32 run
    errors = lm_head_errors(evidence, "cpu")
    assert any("streamed float32" in e for e in errors) and any("never streamed int8" in e for e in errors)
    assert lm_head_errors(full.evidence["lm_head"], "cpu") == []


@needs_ext
def test_bf16_head_keeps_most_greedy_answers():
    ckpt, tokenizer, suite = _bundled(40)
    base = _generate(ckpt, tokenizer, suite, kernel="fused", batch_size=16, max_new_tokens=128)
    bf16 = _generate(ckpt, tokenizer, suite, kernel="fused", batch_size=16, max_new_tokens=128, lm_head="bf16")
    assert set(bf16.evidence["lm_head"]["kernel"]) == {"bfloat16"} and not bf16.activation_errors
    answers = [(suite.score(a.text, item).answer, suite.score(b.text, item).answer)
               for a, b, item in zip(base.completions, bf16.completions, suite.items)]
    same = sum(a == b for a, b in answers) / len(answers)
    print(f"bf16 head: {same:.1%} of {len(answers)} greedy answers as with the float32 head")
    assert same >= 0.9


# ------------------------------------------------------------------ the ablation axis


def test_axes_choose_what_is_ablated():
    assert parse_axes(None) == (("kernel", "scheduler", "prefetch"), frozenset())
    assert parse_axes("lm-head,kernel") == (("kernel",), {"lm-head"})
    assert parse_axes("speculative,lm-head") == ((), {"speculative", "lm-head"})
    with pytest.raises(MoebenchError):
        parse_axes("kernel,speed")
    names = [c.name for c in ablation_matrix(("kernel",), lm_heads=("int8", "fp8"))]
    assert names == ["baseline", "kernel", "lm-head=int8", "kernel+lm-head=int8", "lm-head=fp8", "kernel+lm-head=fp8"]
    configs = {c.name: c for c in ablation_matrix((), lm_heads=("bf16",))}
    assert list(configs) == ["baseline", "lm-head=bf16"]
    assert configs["lm-head=bf16"].to_dict()["approximate"] is True and not configs["baseline"].approximate
    assert [c.name for c in ablation_matrix()] == ["baseline", "kernel", "scheduler", "prefetch", "kernel+scheduler", "all"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint, write_char_tokenizer

    return write_char_tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("m"), "qwen3_e6_k2_norm"))


@pytest.fixture
def data(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}
            for i in range(4)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "test.jsonl").write_text(text)
    (tmp_path / "train.jsonl").write_text(text)
    return tmp_path


def _run(monkeypatch, *args):
    from moebench.cli.app import main

    monkeypatch.setattr(sys, "argv", ["moebench", "run", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code


@needs_ext
def test_run_ablates_kernel_and_lm_head_and_records_the_evidence(tiny_model, data, tmp_path, monkeypatch):
    from moebench.fileio import read_jsonl

    code = _run(monkeypatch, "--model", str(tiny_model), "--suite", "gsm8k", "--data", str(data), "--num-fewshot", "0",
                "--ablate", "--axes", "kernel,lm-head", "--lm-head", "fp8", "--repeats", "1", "--warmup", "1",
                "--max-new-tokens", "4", "--batch-size", "2", "--out", str(tmp_path / "r"), "--run-id", "x")
    assert code in (0, None)
    run = tmp_path / "r" / "x"
    manifest = json.loads((run / "manifest.json").read_text())
    configs = {c["name"]: c for c in manifest["configs"]}
    assert list(configs) == ["baseline", "kernel", "lm-head=fp8", "kernel+lm-head=fp8"]
    assert configs["kernel+lm-head=fp8"] == {"name": "kernel+lm-head=fp8", "kernel": "fused", "scheduler": "static",
                                             "prefetch": "off", "lm_head": "fp8", "approximate": True}
    trials = {t["config"]: t for t in read_jsonl(run / "trials.jsonl")}
    assert set(trials["lm-head=fp8"]["evidence"]["lm_head"]["kernel"]) == {"float8_e4m3fn"}
    assert set(trials["kernel"]["evidence"]["lm_head"]["kernel"]) == {"float32"}
    assert all(t["activation_ok"] for t in trials.values())
    # approximate: no identical-output rule in the gate, and never the headline while an exact config ran
    from moebench.results.gate import evaluate
    from moebench.results.policy import Policy

    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimized"] == "kernel"
    rules = [r.name for r in evaluate(summary, Policy())]
    assert "identical outputs kernel" in rules
    assert not [r for r in rules if r.startswith("identical outputs") and "lm-head" in r]
    assert any("lm-head=fp8" in r for r in rules)  # its accuracy is still judged


@needs_ext
def test_run_with_lm_head_alone_is_one_config(tiny_model, data, tmp_path, monkeypatch):
    from moebench.fileio import read_jsonl

    code = _run(monkeypatch, "--model", str(tiny_model), "--suite", "gsm8k", "--data", str(data), "--num-fewshot", "0",
                "--lm-head", "int8", "--warmup", "1", "--max-new-tokens", "4", "--batch-size", "2",
                "--out", str(tmp_path / "r"), "--run-id", "one")
    assert code in (0, None)
    manifest = json.loads((tmp_path / "r" / "one" / "manifest.json").read_text())
    assert [c["name"] for c in manifest["configs"]] == ["lm-head=int8"]
    (trial,) = read_jsonl(tmp_path / "r" / "one" / "trials.jsonl")
    assert set(trial["evidence"]["lm_head"]["kernel"]) == {"int8"} and trial["activation_ok"]


def test_bad_lm_head_options_are_one_line_errors(tiny_model, data, tmp_path, monkeypatch, capsys):
    common = ["--model", str(tiny_model), "--suite", "gsm8k", "--data", str(data), "--out", str(tmp_path / "r")]
    for extra, message in ((["--lm-head", "int4"], "--lm-head 'int4'"), (["--axes", "kernel"], "--axes needs --ablate"),
                           (["--ablate", "--lm-head", "int8"], "add lm-head to --axes"),
                           (["--ablate", "--axes", "kernel,heads"], "--axes 'kernel,heads'")):
        assert _run(monkeypatch, *common, *extra) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
