"""lm-eval both ways, offline, on real processes.

(a) lm-eval's own `local-completions` model pointed at a running `moebench serve` runs the local
    gsm8k task and the gsm-synth task: every answer and the score equal `moebench run`'s on the
    same items.
(b) `moebench lm-eval` (lm_eval.simple_evaluate with the `moebench` model class) gives the same
    answers; its loglikelihood matches transformers' reference model."""

import json
import subprocess
import sys

import pytest
import torch

from repo_paths import REPO

lm_eval = pytest.importorskip("lm_eval")

from moebench.measuring.lm_eval_model import render_tasks  # noqa: E402
from moebench.measuring.run import bundled_model_path  # noqa: E402
from moebench.serve.app import ServeProcess  # noqa: E402

N_SYNTH = 12
N_GSM8K = 4


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory):
    return _moebench_run(tmp_path_factory.mktemp("run"), ["--suite", "gsm-synth", "--limit", str(N_SYNTH)], "synth")


def _moebench_run(tmp_path, suite_args, name):
    """`moebench run` on the suite; returns {item index: sample} and the summary's accuracy."""
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "moebench", "run", *suite_args, "--warmup", "0", "--out", str(out), "--run-id", name]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    samples = [json.loads(line) for line in (out / name / "samples.jsonl").read_text().splitlines()]
    accuracy = json.loads((out / name / "summary.json").read_text())["configs"][0]["accuracy"]
    return {int(s["item_id"].rsplit("/", 1)[1]): s for s in samples}, accuracy


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, gsm8k_dir_module):
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    assert render_tasks(out, gsm8k_dir_module) == ["gsm_synth", "gsm8k_local"]
    return out


@pytest.fixture(scope="module")
def gsm8k_dir_module():
    path = (REPO / ".." / "shared" / "data" / "gsm8k").resolve()
    if not (path / "test.jsonl").is_file():
        pytest.skip(f"offline GSM8K data not found at {path}")
    return path


def _check_against_run(results, task, run_samples, run_accuracy, n):
    samples = sorted((s for s in results["samples"][task] if s["filter"] == "flexible-extract"),
                     key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(n))
    for s in samples:
        assert s["resps"][0][0] == run_samples[s["doc_id"]]["output"], s["doc_id"]
    flexible = results["results"][task]["exact_match,flexible-extract"]
    assert round(flexible * n) == run_accuracy["correct"] and run_accuracy["total"] == n


def test_local_completions_against_moebench_serve_equals_moebench_run(tmp_path, task_dir, gsm8k_dir_module,
                                                                       synth_run, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    synth_samples, synth_acc = synth_run
    gsm8k_run, gsm8k_acc = _moebench_run(tmp_path, ["--suite", "gsm8k", "--data", str(gsm8k_dir_module),
                                                    "--num-fewshot", "0", "--limit", str(N_GSM8K)], "gsm8k")
    with ServeProcess(["--scheduler", "continuous", "--kernel", "fused"]) as server:
        args = (f"base_url={server.url}/v1/completions,model=bundled,tokenizer_backend=None,"
                "tokenized_requests=False,num_concurrent=8,max_retries=1")
        ours = TaskManager(include_path=str(task_dir), include_defaults=False)
        synth = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["gsm_synth"],
                                        limit=N_SYNTH, task_manager=ours, log_samples=True)
        gsm8k = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["gsm8k_local"],
                                        num_fewshot=0, limit=N_GSM8K, task_manager=ours, log_samples=True)
    _check_against_run(synth, "gsm_synth", synth_samples, synth_acc, N_SYNTH)
    _check_against_run(gsm8k, "gsm8k_local", gsm8k_run, gsm8k_acc, N_GSM8K)
    assert synth_acc["correct"] >= N_SYNTH * 3 // 4  # the bundled model solves its own suite


def test_moebench_lm_eval_command_gives_the_same_answers(tmp_path, synth_run):
    out = tmp_path / "lm_eval.json"
    r = subprocess.run([sys.executable, "-m", "moebench", "lm-eval", "--tasks", "gsm-synth", "--limit", str(N_SYNTH),
                        "--kernel", "fused", "--scheduler", "continuous", "--batch-size", "4", "--output", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(out.read_text())
    assert "gsm_synth: " in r.stdout and results["moebench"]["switches"]["kernel"] == "fused"
    _check_against_run(results, "gsm_synth", *synth_run, N_SYNTH)


def test_bad_arguments_are_one_line_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moebench", "lm-eval", "--tasks", "gsm-synth", "--limit", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == "moebench: error: --limit must be >= 1, got 0"
    r = subprocess.run([sys.executable, "-m", "moebench", "lm-eval", "--tasks", "gsm8k", "--data", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "train.jsonl: no such file" in r.stderr and r.stderr.strip().count("\n") == 0


def test_loglikelihood_matches_transformers_and_knows_the_greedy_answer():
    from lm_eval.api.instance import Instance
    from transformers import AutoModelForCausalLM

    from moebench.measuring.lm_eval_model import MoebenchLM

    lm = MoebenchLM(kernel="fused")
    context = "Question: Zoe has 25 apples. Then she buys 7 more apples. How many apples does Zoe have?\nAnswer:"
    greedy = lm.generate_until([Instance("generate_until", {}, (context, {"until": ["\n"], "max_gen_toks": 12}), 0)])[0]
    pairs = [(context, greedy), (context, " She eats all of them."), (context + " ", "After")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    lm.close()
    assert got[0][1] is True and got[1][1] is False

    reference = AutoModelForCausalLM.from_pretrained(str(bundled_model_path()), dtype=torch.float32)
    tok = lm.engine.tokenizer
    for (ctx, cont), (logprob, _) in zip(pairs, got):
        stripped = ctx.rstrip()
        cont = ctx[len(stripped):] + cont
        whole = tok.encode(stripped + cont).ids
        n_ctx = len(tok.encode(stripped).ids)
        with torch.no_grad():
            logits = reference(torch.tensor([whole])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(whole[1:])[:, None])[:, 0]
        assert logprob == pytest.approx(lp[n_ctx - 1:].sum().item(), abs=1e-3)
