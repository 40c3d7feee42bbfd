"""Speculative decoding (engine/speculative.py) on the bundled model: prompt-lookup drafts verified in
one decode forward give the tokens plain decoding gives, greedy and sampled, with batch > 1, both
schedulers, the native decode path, offloaded experts with prefetch, and preemption; rejected drafts
leave the KV cache as plain decoding leaves it; the acceptance rule emits the target distribution
whatever the draft; a speculative run that drafted nothing is an activation error."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig
from moebench.engine.sampling import GREEDY, SamplingParams, request_seed
from moebench.engine.sequence import Sequence
from moebench.engine.runner import StepPlan
from moebench.engine.speculative import SpecSettings, Speculator, ngram_draft
from moebench.errors import MoebenchError
from moebench.suites import load_suite

N_ITEMS = 12
MAX_NEW = 64


@pytest.fixture(scope="module")
def suite():
    return load_suite("gsm-synth", limit=N_ITEMS)


def _requests(suite, sampling):
    return [Request(item.id, suite.prompt(item), MAX_NEW, tuple(suite.stop),
                    sampling if sampling.greedy else replace(sampling, seed=request_seed(0, 0, item.id)))
            for item in suite.items]


def _generate(checkpoints, tokenizer, suite, sampling=GREEDY, **runtime):
    # every step drafts, whatever the batch: these tests are about exactness, not the batch policy
    rt = RuntimeConfig(**{"batch_size": 16, "max_new_tokens": MAX_NEW, "offload_tier": "host", "spec_max_batch": 16,
                          **runtime})
    return Engine(checkpoints(rt), tokenizer, rt).generate(_requests(suite, sampling))


def _ids(result):
    return [c.output_ids for c in result.completions]


SAMPLINGS = {"greedy": GREEDY, "t2": SamplingParams(2.0)}


@pytest.fixture(scope="module")
def plain(checkpoints, tokenizer, suite):
    return {name: _generate(checkpoints, tokenizer, suite, s) for name, s in SAMPLINGS.items()}


CONFIGS = {
    "static-16": dict(),
    "continuous-5": dict(scheduler="continuous", batch_size=5),
    "fused-native-1": dict(kernel="fused", batch_size=1, decode_path="native"),
    "offload-lookahead": dict(kernel="fused", scheduler="continuous", prefetch="lookahead", expert_budget=0.5,
                              batch_size=5, spec_tokens=2),
}


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("config", CONFIGS)
def test_speculative_outputs_equal_plain_decoding(checkpoints, tokenizer, suite, plain, sampling, config):
    result = _generate(checkpoints, tokenizer, suite, SAMPLINGS[sampling], speculative="ngram", **CONFIGS[config])
    assert not result.activation_errors
    assert _ids(result) == _ids(plain[sampling])
    ev = result.evidence["speculative"]
    assert ev["verify_steps"] > 0 and 0 < ev["accepted"] < ev["drafted"]
    assert ev["tokens_per_verify"] > 1
    assert sum(ev["accepted_length_histogram"]) == sum(ev["drafted_by_position"][:1])
    lengths = [n for s in result.steps for n in s["accepted_lengths"]]  # per step, per verifying sequence
    assert [lengths.count(n) for n in range(len(ev["accepted_length_histogram"]))] == ev["accepted_length_histogram"]
    assert sum(s["accepted"] for s in result.steps) == ev["accepted"] == sum(lengths)
    # decode tok/s counts emitted tokens: the plain run's tokens, more than one per sequence and step
    spec_decode = [s for s in result.steps if s["phase"] != "prefill"]
    plain_decode = [s for s in plain[sampling].steps if s["phase"] != "prefill"]
    assert sum(s["decode_tokens"] for s in spec_decode) == sum(s["decode_tokens"] for s in plain_decode)
    pure = [s for s in spec_decode if s["phase"] == "decode"]
    assert sum(s["decode_tokens"] for s in pure) > sum(s["batch_size"] for s in pure)
    if sampling != "greedy":  # the draws are the plain run's, one per emitted or verified position
        assert result.evidence["sampling"]["sampled_positions"] > 0


def test_sampling_at_2_leaves_the_greedy_path(plain):
    assert sum(a != b for a, b in zip(_ids(plain["t2"]), _ids(plain["greedy"]))) >= N_ITEMS // 2


def test_preemption_and_recompute_under_speculation(checkpoints, tokenizer, suite, plain, monkeypatch):
    longest = max(len(tokenizer.encode(suite.prompt(item)).ids) for item in suite.items) + MAX_NEW
    monkeypatch.setattr(Engine, "_kv_blocks", lambda self, seqs: 2 * -(-longest // 4) + 1)
    for name in SAMPLINGS:
        result = _generate(checkpoints, tokenizer, suite, SAMPLINGS[name], speculative="ngram", scheduler="continuous",
                           batch_size=4, kv_block_size=4)
        assert result.evidence["scheduler"]["preemptions"] > 0
        assert result.evidence["speculative"]["accepted"] > 0
        assert _ids(result) == _ids(plain[name])


def test_rejected_drafts_leave_the_cache_as_plain_decoding_does(checkpoints, tokenizer, suite):
    rt = RuntimeConfig(batch_size=1, max_new_tokens=MAX_NEW, offload_tier="host", kernel="fused")
    ckpt = checkpoints(rt)
    prompt = suite.prompt(suite.items[0])
    sessions = {}
    for name, runtime in (("plain", rt), ("spec", replace(rt, speculative="ngram"))):
        engine = Engine(ckpt, tokenizer, runtime)
        session = engine.session(2048)
        seq = Sequence(Request("a", prompt, MAX_NEW), engine.encode(prompt), MAX_NEW, 0.0)
        session.add(seq)
        sessions[name] = (session, seq)
    spec, sseq = sessions["spec"]
    rejected = 0
    while not rejected and spec.has_work():
        before = spec.speculator.drafted - spec.speculator.accepted
        spec.step()
        rejected = spec.speculator.drafted - spec.speculator.accepted - before
        bm = spec.block_manager
        # blocks past the kept length went back: the table holds what the tokens need, no more
        assert len(sseq.block_table) == bm.blocks_needed(sseq.num_tokens)
        assert bm.num_used == len(sseq.block_table)
    assert rejected > 0 and not sseq.finished
    plain, pseq = sessions["plain"]
    while len(pseq.output_ids) < len(sseq.output_ids):
        plain.step()
    assert pseq.output_ids == sseq.output_ids and pseq.num_cached == sseq.num_cached
    bs = rt.kv_block_size
    slots = lambda seq: torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(seq.num_cached)])
    # the kept positions hold the kept tokens' K/V (a rejected draft's left there would differ by
    # O(1)); not bit for bit: the projections round differently for 5 rows than for 1, as they do
    # between batch sizes (the largest difference seen: 4e-7)
    for layer in range(len(spec.kv.k)):
        torch.testing.assert_close(spec.kv.k[layer][slots(sseq)], plain.kv.k[layer][slots(pseq)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(spec.kv.v[layer][slots(sseq)], plain.kv.v[layer][slots(pseq)], atol=1e-5, rtol=1e-5)
    for _ in range(8):  # and decoding goes on as the plain run's
        if not spec.has_work():
            break
        spec.step()
        while plain.has_work() and len(pseq.output_ids) < len(sseq.output_ids):
            plain.step()
        assert pseq.output_ids[:len(sseq.output_ids)] == sseq.output_ids


def test_a_speculative_run_that_drafts_nothing_is_an_activation_error(checkpoints, tokenizer, suite):
    rt = RuntimeConfig(batch_size=16, max_new_tokens=2, offload_tier="host", speculative="ngram", spec_max_batch=4)
    requests = [Request(item.id, suite.prompt(item), 2, tuple(suite.stop)) for item in suite.items]
    result = Engine(checkpoints(rt), tokenizer, rt).generate(requests)  # its one decode step has 12 sequences
    assert result.evidence["speculative"]["drafted"] == 0
    assert result.evidence["speculative"]["steps_off_by_batch"] > 0
    assert any("no token was drafted" in e for e in result.activation_errors)


def test_bad_settings_are_refused():
    for bad in [dict(speculative="eagle"), dict(speculative="ngram", spec_tokens=0),
                dict(speculative="ngram", spec_max_batch=0)]:
        with pytest.raises(MoebenchError):
            RuntimeConfig(**bad)


def test_a_model_with_recurrent_state_is_refused(tmp_path):
    from tiny_bailing import make_tiny_bailing

    from moebench.engine import load_checkpoint

    ckpt = load_checkpoint(make_tiny_bailing(tmp_path / "ling"))
    engine = Engine(ckpt, None, RuntimeConfig(speculative="ngram"))
    with pytest.raises(MoebenchError, match="rolls back"):
        engine.generate([Request("a", "")], prompt_ids=[[1, 2, 3, 1, 2]])


def test_ngram_draft_proposes_what_followed_the_longest_recent_suffix():
    assert ngram_draft([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert ngram_draft([5, 1, 2, 7, 1, 2, 8, 4, 1, 2], 2) == [8, 4]  # the most recent earlier match
    assert ngram_draft([4, 7, 3, 8, 3], 4) == [8, 3]  # only a 1-gram recurs
    assert ngram_draft([1, 2, 3], 4) == []
    assert ngram_draft([6, 6], 4) == [6]


# ----------------------------------------------------------------------------- the acceptance rule


def _emitted(logits_row, params, draft, n, start=0):
    """The first emitted token of n sequences (seeds start..start+n) verifying `draft` against
    target logits `logits_row` at their output position 0, through Speculator.select."""
    spec = Speculator(SpecSettings("ngram", len(draft)))
    seqs = [Sequence(Request(str(i), "", 8, (), replace(params, seed=start + i)), [0], 8, 0.0) for i in range(n)]
    rows = torch.tensor(np.tile(logits_row, (n * (len(draft) + 1), 1)))
    out = spec.select(seqs, _verifying(seqs, [list(draft)] * n), rows, None)
    return np.array([e[0] for e in out]), spec


def _verifying(seqs, drafts):
    """The plan of a step in which `seqs` (one new token each, 0) verify `drafts`."""
    new = [[0] for _ in seqs]
    rows, cached, tables, counts = Speculator.rows(seqs, new, drafts)
    return StepPlan(new, [False] * len(seqs), rows, cached, tables, drafts, counts)


@pytest.mark.parametrize("top_k", [None, 3])
def test_acceptance_emits_the_target_distribution_whatever_the_draft(top_k):
    row = np.array([2.0, 0.5, -1.0, 1.5, -3.0, 0.0], dtype=np.float32)
    params = SamplingParams(1.0, top_k=top_k)
    w = np.exp(row.astype(np.float64) - row.max())
    if top_k:
        w[np.argsort(-row, kind="stable")[top_k:]] = 0
    p = w / w.sum()
    n = 30000
    for draft in (int(np.argmin(np.where(p > 0, p, 1))), 4):  # the least likely kept token; one never kept when cut
        got, spec = _emitted(row, params, [draft], n)
        freq = np.bincount(got, minlength=len(row)) / n
        kept = p > 0
        assert np.all(freq[~kept] == 0)
        chi2 = float(((freq[kept] - p[kept]) ** 2 / p[kept]).sum() * n)
        dof = int(kept.sum()) - 1
        assert chi2 < dof + 6 * math.sqrt(2 * dof)
        # the rule: accept with probability p(draft) (q is a point mass), else p without the draft
        rate = spec.accepted / spec.drafted
        assert abs(rate - p[draft]) <= 5 * math.sqrt(p[draft] * (1 - p[draft]) / n) + 1 / n
        rejected = got[got != draft]
        if len(rejected):
            resid = np.where(np.arange(len(row)) == draft, 0, p)
            resid /= resid.sum()
            rf = np.bincount(rejected, minlength=len(row)) / len(rejected)
            assert np.all(np.abs(rf - resid) <= 5 * np.sqrt(resid * (1 - resid) / len(rejected)) + 1 / len(rejected))


def test_acceptance_stops_at_the_first_rejection_and_emits_the_correction():
    row = np.full(5, -20.0, dtype=np.float32)
    row[3] = 0.0  # the target is token 3 at every position (greedy)
    seq = Sequence(Request("a", "", 8), [0], 8, 0.0)
    spec = Speculator(SpecSettings("ngram", 3))
    logits = torch.tensor(np.tile(row, (4, 1)))
    out = spec.select([seq], _verifying([seq], [[3, 1, 3]]), logits, None)
    assert out == [[3, 3]]
    assert spec.accepted_hist == [0, 1, 0, 0]
    assert spec.accepted_at == [1, 0, 0] and spec.drafted_at == [1, 1, 1]


# ----------------------------------------------------------------------------- moebench run


def test_run_ablates_the_speculative_axis_with_its_evidence(tmp_path, monkeypatch):
    import json
    import sys

    from moebench.cli.app import main

    monkeypatch.setattr(sys, "argv", ["moebench", "run", "--ablate", "--axes", "kernel,speculative", "--limit", "8",
                                      "--max-new-tokens", "48", "--warmup", "2", "--repeats", "1", "--temperature", "2",
                                      "--spec-tokens", "3", "--spec-max-batch", "16", "--offload-tier", "host", "--out", str(tmp_path),
                                      "--run-id", "spec"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code in (0, None)
    d = tmp_path / "spec"
    manifest = json.loads((d / "manifest.json").read_text())
    assert [c["name"] for c in manifest["configs"]] == ["baseline", "kernel", "speculative=ngram",
                                                         "kernel+speculative=ngram"]
    record = manifest["runtime"]["speculative"]
    assert (record["method"], record["tokens"], record["max_batch"], record["axis_configs"]) == (
        "ngram", 3, 16, ["speculative=ngram", "kernel+speculative=ngram"])
    trials = {t["config"]: t for t in map(json.loads, (d / "trials.jsonl").read_text().splitlines())}
    for name, t in trials.items():
        ev = t["evidence"]["speculative"]
        assert t["activation_ok"]
        assert (ev["method"] == "off") == ("speculative" not in name)
        if "speculative" in name:
            assert ev["tokens"] == 3 and ev["accepted"] > 0 and len(ev["acceptance_by_position"]) == 3
    samples = {}
    for row in map(json.loads, (d / "samples.jsonl").read_text().splitlines()):
        samples.setdefault(row["config"], {})[row["item_id"]] = row["output"]
    assert all(samples[c] == samples["baseline"] for c in samples)  # sampled at T 2, identical
    summary = {c["name"]: c for c in json.loads((d / "summary.json").read_text())["configs"]}
    spec = summary["speculative=ngram"]["activation"]["evidence"]["speculative"]
    assert spec["tokens_per_verify"] > 1 and spec["acceptance_by_position"][0] > 0


def test_draft_rows_read_their_own_causal_context():
    """Draft row j of a sequence with num_cached tokens cached attends to num_cached + j + 1 positions."""
    from moebench.engine.speculative import draft_context_reads

    for cached in (0, 7, 160):
        for k in range(6):
            assert draft_context_reads(cached, k) == sum(cached + j + 1 for j in range(1, k + 1))
