"""Sampling (engine/sampling.py): draws follow the tempered, filtered distribution; a request's tokens
depend on its seed and its logits alone, so every exact optimization (kernel, scheduler, prefetch,
offloading, a batch of another size, preemption and recompute) gives the baseline's samples;
`moebench serve` given the same seed gives the in-process tokens; trials draw anew; temperature 0
is the greedy path unchanged; a temperature the engine did not apply is an activation error.

The bundled model is very sure of itself (at temperature 0.6 about one item in 200 leaves the
greedy path), so the engine tests sample at 2.0 as well, where most items leave it within a few
tokens: an order- or batch-dependent draw could not pass them."""

import asyncio
import math
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig
from moebench.engine.sampling import (GREEDY, SamplingParams, request_seed, sample_row, sample_token_ids,
                                      sampling_activation_errors, uniform)
from moebench.errors import MoebenchError
from moebench.suites import load_suite

N_ITEMS = 12
MAX_NEW = 40


# ----------------------------------------------------------------------------- the sampler alone


def _tempered(row, t):
    w = np.exp((row.astype(np.float64) - row.max()) / t)
    return w / w.sum()


def _frequencies(row, params, n=20000, seed=11):
    picks = [sample_row(row, params, uniform(seed, k)) for k in range(n)]
    return np.bincount(picks, minlength=len(row)) / n


@pytest.mark.parametrize("vocab", [7, 3000])  # one running sum; blocks of 256 (_Running)
def test_draws_follow_the_tempered_distribution(vocab):
    rng = np.random.default_rng(vocab)
    row = rng.normal(size=vocab).astype(np.float32) * (1.0 if vocab > 100 else 2.0)
    n = 20000
    p = _tempered(row, 0.7)
    got = _frequencies(row, SamplingParams(0.7), n)
    assert np.all(np.abs(got - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1 / n)
    chi2 = float(((got - p) ** 2 / p).sum() * n)
    assert chi2 < vocab + 6 * math.sqrt(2 * vocab)  # a chi-square with vocab-1 degrees of freedom


def test_top_k_and_top_p_keep_exactly_their_set_and_renormalize():
    row = np.array([0.5, 2.0, -1.0, 1.5, 2.0, 0.0, 1.0], dtype=np.float32)
    n = 20000
    p = _tempered(row, 1.0)
    # top-k 3: the two 2.0s and the 1.5
    got = _frequencies(row, SamplingParams(1.0, top_k=3), n)
    keep = np.array([1, 3, 4])
    assert set(np.flatnonzero(got)) == set(keep)
    q = p[keep] / p[keep].sum()
    assert np.all(np.abs(got[keep] - q) <= 5 * np.sqrt(q * (1 - q) / n))
    # top-p: the shortest prefix (by probability) that reaches p; 0.6 needs the two 2.0s and the 1.5
    order = np.argsort(-p, kind="stable")
    need = int(np.searchsorted(np.cumsum(p[order]), 0.6)) + 1
    got = _frequencies(row, SamplingParams(1.0, top_p=0.6), n)
    assert set(np.flatnonzero(got)) == set(order[:need]) == {1, 3, 4}
    # both: top-p measured inside the top-k set
    got = _frequencies(row, SamplingParams(1.0, top_p=0.5, top_k=3), n)
    assert set(np.flatnonzero(got)) == {1, 4}


def test_ties_are_broken_by_the_lower_token_id():
    row = np.array([1.0, 3.0, 0.0, 3.0, 3.0], dtype=np.float32)
    for k in range(50):
        assert sample_row(row, SamplingParams(1.0, top_k=1), uniform(5, k)) == 1  # as argmax
        assert sample_row(row, SamplingParams(1.0, top_p=1e-6), uniform(5, k)) == 1
        assert sample_row(row, SamplingParams(1.0, top_k=2), uniform(5, k)) in (1, 3)


def test_a_row_draws_the_same_alone_in_any_batch_and_in_any_order():
    rng = np.random.default_rng(3)
    logits = torch.tensor(rng.normal(size=(9, 2000)) * 2, dtype=torch.float32)
    params = [SamplingParams(t, p, k, seed) for t, p, k, seed in
              [(0.6, 1.0, None, 1), (1.3, 0.9, None, 2), (0.0, 1.0, None, 3), (2.0, 1.0, 40, 4), (1.0, 0.8, 100, 5),
               (0.6, 1.0, None, 6), (3.0, 1.0, None, 7), (0.0, 1.0, None, 8), (1.0, 0.95, None, 9)]]
    positions = [0, 5, 9, 2, 7, 1, 30, 4, 3]
    together, drawn = sample_token_ids(logits, params, positions)
    assert drawn == 7
    alone = [sample_token_ids(logits[i:i + 1], params[i:i + 1], positions[i:i + 1])[0][0] for i in range(9)]
    perm = [4, 0, 8, 2, 6, 1, 3, 7, 5]
    shuffled, _ = sample_token_ids(logits[perm], [params[i] for i in perm], [positions[i] for i in perm])
    assert together == alone
    assert shuffled == [together[i] for i in perm]
    assert together[2] == int(logits[2].argmax()) and together[7] == int(logits[7].argmax())


def test_seeds_and_uniforms_are_pure_functions_of_their_keys():
    seeds = {request_seed(run, trial, item) for run in (0, 1) for trial in (0, 1, 2) for item in ("a", "b")}
    assert len(seeds) == 12 and all(0 <= s < 1 << 63 for s in seeds)
    assert request_seed(0, 1, "a") == request_seed(0, 1, "a")
    values = [uniform(s, k) for s in (0, 1, 1 << 62) for k in range(1000)]
    assert all(0 <= v < 1 for v in values) and len(set(values)) == len(values)
    assert abs(np.mean(values) - 0.5) < 0.02
    assert uniform(7, 3) == uniform(7, 3)


def test_settings_no_sampler_can_honour_are_refused():
    for bad in [dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=0.5, top_p=0.0),
                dict(temperature=0.5, top_p=1.5), dict(temperature=0.5, top_k=0), dict(temperature=0.5, seed=0.5)]:
        with pytest.raises(MoebenchError):
            SamplingParams(**bad)
    with pytest.raises(MoebenchError, match="non-finite"):
        sample_row(np.array([0.0, np.nan], dtype=np.float32), SamplingParams(1.0), 0.5)


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def suite():
    return load_suite("gsm-synth", limit=N_ITEMS)




def _requests(suite, sampling, trial=0):
    return [Request(item.id, suite.prompt(item), MAX_NEW, tuple(suite.stop),
                    sampling if sampling.greedy else replace(sampling, seed=request_seed(0, trial, item.id)))
            for item in suite.items]


def _generate(checkpoints, tokenizer, suite, sampling, trial=0, **runtime):
    rt = RuntimeConfig(**{"batch_size": 16, "max_new_tokens": MAX_NEW, "offload_tier": "host", **runtime})
    return Engine(checkpoints(rt), tokenizer, rt).generate(_requests(suite, sampling, trial))


SETTINGS = {"t0.6": SamplingParams(0.6), "t2": SamplingParams(2.0), "t2-top-p": SamplingParams(2.0, top_p=0.9),
            "t2-top-k": SamplingParams(2.0, top_k=20)}
EXACT = {
    "kernel": dict(kernel="fused"),
    "scheduler": dict(scheduler="continuous", batch_size=5),
    "prefetch": dict(prefetch="lookahead", expert_budget=0.5),
    "all": dict(kernel="fused", scheduler="continuous", prefetch="lookahead", expert_budget=0.5, batch_size=5),
    "budget-0.5": dict(expert_budget=0.5),
    "batch-3": dict(batch_size=3),
}


@pytest.fixture(scope="module")
def baselines(checkpoints, tokenizer, suite):
    out = {name: _generate(checkpoints, tokenizer, suite, s) for name, s in SETTINGS.items()}
    out["greedy"] = _generate(checkpoints, tokenizer, suite, GREEDY)
    return out


def _ids(result):
    return [c.output_ids for c in result.completions]


def test_sampling_at_2_leaves_the_greedy_path_so_the_equalities_below_can_fail(baselines):
    greedy = _ids(baselines["greedy"])
    assert sum(a != b for a, b in zip(_ids(baselines["t2"]), greedy)) >= N_ITEMS // 2
    for name in SETTINGS:
        ev = baselines[name].evidence["sampling"]
        # one draw per position (an end-of-sequence token is drawn, then dropped from the output)
        assert ev["greedy_positions"] == 0
        assert ev["sampled_positions"] >= sum(c.output_tokens for c in baselines[name].completions)
        assert ev["settings"] == [list(SETTINGS[name].setting())]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("config", EXACT)
def test_every_exact_optimization_gives_the_baseline_samples(checkpoints, tokenizer, suite, baselines, setting, config):
    result = _generate(checkpoints, tokenizer, suite, SETTINGS[setting], **EXACT[config])
    assert not result.activation_errors
    assert _ids(result) == _ids(baselines[setting])


@pytest.mark.parametrize("setting", ["t0.6", "t2"])
def test_preemption_and_recompute_give_the_baseline_samples(checkpoints, tokenizer, suite, baselines, monkeypatch,
                                                             setting):
    # 4-token blocks, room for about two whole requests of the four running: some are preempted and recomputed
    longest = max(len(tokenizer.encode(suite.prompt(item)).ids) for item in suite.items) + MAX_NEW
    monkeypatch.setattr(Engine, "_kv_blocks", lambda self, seqs: 2 * -(-longest // 4) + 1)
    result = _generate(checkpoints, tokenizer, suite, SETTINGS[setting], scheduler="continuous", batch_size=4,
                       kv_block_size=4)
    assert result.evidence["scheduler"]["preemptions"] > 0
    assert _ids(result) == _ids(baselines[setting])


def test_trials_draw_different_samples_and_a_trial_repeats_exactly(checkpoints, tokenizer, suite, baselines):
    again = _generate(checkpoints, tokenizer, suite, SETTINGS["t2"], trial=0)
    other = _generate(checkpoints, tokenizer, suite, SETTINGS["t2"], trial=1)
    assert _ids(again) == _ids(baselines["t2"])
    assert sum(a != b for a, b in zip(_ids(other), _ids(baselines["t2"]))) >= N_ITEMS // 2


def test_temperature_0_rows_keep_the_greedy_tokens_beside_sampled_rows(checkpoints, tokenizer, suite, baselines):
    requests = _requests(suite, GREEDY)
    sampled = _requests(suite, SETTINGS["t2"])
    mixed = [s if i % 2 else g for i, (g, s) in enumerate(zip(requests, sampled))]
    rt = RuntimeConfig(batch_size=16, max_new_tokens=MAX_NEW)
    result = Engine(checkpoints(rt), tokenizer, rt).generate(mixed)
    greedy, t2 = _ids(baselines["greedy"]), _ids(baselines["t2"])
    assert _ids(result) == [t2[i] if i % 2 else greedy[i] for i in range(N_ITEMS)]
    ev = result.evidence["sampling"]
    assert ev["sampled_positions"] > 0 and ev["greedy_positions"] > 0
    assert baselines["greedy"].evidence["sampling"]["sampled_positions"] == 0


def test_top_k_1_is_greedy_through_the_sampler(checkpoints, tokenizer, suite, baselines):
    result = _generate(checkpoints, tokenizer, suite, SamplingParams(2.0, top_k=1))
    assert _ids(result) == _ids(baselines["greedy"])
    assert result.evidence["sampling"]["sampled_positions"] > 0


def test_a_temperature_the_engine_did_not_apply_is_an_activation_error(baselines):
    wanted = SamplingParams(0.6, seed=0)
    assert sampling_activation_errors(wanted, baselines["t0.6"].evidence) == []
    assert "drew no token" in sampling_activation_errors(wanted, baselines["greedy"].evidence)[0]
    assert "applied" in sampling_activation_errors(wanted, baselines["t2"].evidence)[0]
    assert sampling_activation_errors(GREEDY, baselines["greedy"].evidence) == []


# ----------------------------------------------------------------------------- moebench serve


def test_serve_with_the_same_seed_gives_the_in_process_tokens(suite, tokenizer, baselines):
    from moebench.serve.app import ServeProcess

    async def ask(url, setting):
        s = SETTINGS[setting]
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(item):
                body = {"prompt": tokenizer.encode(suite.prompt(item)).ids, "max_tokens": MAX_NEW,
                        "stop": list(suite.stop), "temperature": s.temperature, "top_p": s.top_p,
                        "top_k": s.top_k if s.top_k else -1, "seed": request_seed(0, 0, item.id)}
                r = await client.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            return await asyncio.gather(*(one(item) for item in suite.items))

    with ServeProcess(["--scheduler", "continuous", "--batch-size", "4", "--kernel", "fused",
                       "--max-new-tokens", str(MAX_NEW)]) as server:
        for setting in ("t2", "t2-top-p", "t0.6"):
            texts = asyncio.run(ask(server.url, setting))
            assert texts == [c.text for c in baselines[setting].completions], setting
        ev = httpx.get(server.url + "/v1/moebench/evidence", timeout=30).json()["evidence"]["sampling"]
        assert ev["sampled_positions"] > 0


# ----------------------------------------------------------------------------- lm-eval's model


def test_lm_eval_generation_settings_reach_the_sampler(suite, baselines):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from moebench.measuring.lm_eval_model import MoebenchLM

    lm = MoebenchLM(kernel="fused", max_gen_toks=MAX_NEW)
    try:
        def ask(kwargs, doc=0):
            item = suite.items[doc]
            args = (suite.prompt(item), {"until": list(suite.stop), "max_gen_toks": MAX_NEW, **kwargs})
            return lm.generate_until([Instance("generate_until", {}, args, doc, metadata=("t", doc, 1))])[0]

        assert ask({"do_sample": False, "temperature": 0.0}) == baselines["greedy"].completions[0].text
        sampled = [ask({"do_sample": True, "temperature": 2.0}, doc) for doc in range(6) for _ in range(2)]
        assert lm.evidence[-1]["sampling"]["settings"] == [[2.0, 1.0, None]]
        # a repeat of a document draws a new stream; over six documents some pair differs
        assert any(sampled[2 * d] != sampled[2 * d + 1] for d in range(6))
        with pytest.raises(MoebenchError, match="do_sample=false with temperature"):
            ask({"do_sample": False, "temperature": 0.7})
    finally:
        lm.close()


# ----------------------------------------------------------------------------- moebench run


def test_run_samples_with_per_trial_seeds_and_records_how(tmp_path, monkeypatch):
    import json
    import sys

    from moebench.cli.app import main

    def run(run_id, *extra):
        monkeypatch.setattr(sys, "argv", ["moebench", "run", "--limit", "8", "--max-new-tokens", "24", "--warmup", "2",
                                          "--out", str(tmp_path), "--run-id", run_id, *extra])
        with pytest.raises(SystemExit) as exc:
            main()
        assert exc.value.code in (0, None)
        d = tmp_path / run_id
        samples = {}
        for line in (d / "samples.jsonl").read_text().splitlines():
            row = json.loads(line)
            samples[(row["config"], row["trial"], row["item_id"])] = row["output"]
        trials = [json.loads(line) for line in (d / "trials.jsonl").read_text().splitlines()]
        return json.loads((d / "manifest.json").read_text()), samples, trials

    manifest, samples, trials = run("hot", "--temperature", "2", "--top-k", "50", "--repeats", "2", "--ablate")
    record = manifest["runtime"]["sampling"]
    assert (record["mode"], record["temperature"], record["top_k"], record["run_seed"]) == ("sampling", 2.0, 50, 0)
    assert all(t["evidence"]["sampling"]["sampled_positions"] > 0 and t["activation_ok"] for t in trials)
    items = sorted({k[2] for k in samples})
    configs = sorted({k[0] for k in samples})
    for trial in (0, 1):  # every exact configuration draws the baseline's samples
        assert all(samples[(c, trial, i)] == samples[("baseline", trial, i)] for c in configs for i in items)
    # trials draw anew
    assert sum(samples[("baseline", 0, i)] != samples[("baseline", 1, i)] for i in items) >= len(items) // 2
    _, greedy, trials = run("cold")
    assert all(t["evidence"]["sampling"]["sampled_positions"] == 0 for t in trials)
    assert sum(greedy[("baseline", 0, i)] != samples[("baseline", 0, i)] for i in items) >= len(items) // 2
