"""Continuous batching: every request completes exactly once, with the tokens it gets when run
alone, whatever the admission order, under KV back-pressure and preemption; affinity admission
lowers distinct experts per step when requests do cluster, and never starves a request."""

import random

import pytest
import torch

import moebench.engine.admission as admission
from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.kv_cache import BlockManager
from moebench.engine.scheduler import ContinuousScheduler, make_scheduler, scheduler_activation_errors
from moebench.engine.sequence import Sequence
from moebench.errors import MoebenchError
from tiny_models import make_tiny_checkpoint

NUM_REQUESTS = 9


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return load_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp("sched"), "qwen3_e7_k4"))


@pytest.fixture(scope="module")
def workload():
    """Prompts of 3..30 tokens and 1..24 new tokens each, so requests finish at different steps."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 31, (NUM_REQUESTS,), generator=g).tolist()
    prompts = [torch.randint(2, 211, (n,), generator=g).tolist() for n in lengths]
    max_new = torch.randint(1, 25, (NUM_REQUESTS,), generator=g).tolist()
    requests = [Request(f"r{i}", "", m) for i, m in enumerate(max_new)]
    return requests, prompts


@pytest.fixture(scope="module")
def alone(ckpt, workload):
    requests, prompts = workload
    torch.set_num_threads(1)
    return [Engine(ckpt, None, RuntimeConfig(batch_size=1)).generate([r], prompt_ids=[p]).completions[0].output_ids
            for r, p in zip(requests, prompts)]


def check_complete(result, workload, alone):
    requests, _ = workload
    ids = [c.id for c in result.completions]
    assert sorted(ids) == sorted(r.id for r in requests) and len(set(ids)) == len(ids)  # each exactly once
    for req, c, expected in zip(requests, result.completions, alone):
        assert c.id == req.id
        assert c.output_ids == expected, f"{req.id} differs from its solo run"
        assert len(c.output_ids) == req.max_new_tokens and c.finish_reason == "length"


@pytest.mark.parametrize("policy", ["fifo", "affinity"])
def test_every_request_completes_once_as_if_alone(ckpt, workload, alone, policy):
    requests, prompts = workload
    runtime = RuntimeConfig(batch_size=3, scheduler="continuous", admission=policy)
    result = Engine(ckpt, None, runtime).generate(requests, prompt_ids=prompts)
    check_complete(result, workload, alone)
    ev = result.evidence["scheduler"]
    assert ev["admissions"] == NUM_REQUESTS and ev["admissions_mid_flight"] > 0 and ev["preemptions"] == 0
    assert ev["mid_flight_opportunities"] > 0
    assert not result.activation_errors
    # decode steps stay pure: a step is all prefill or all decode, and never exceeds the batch size
    assert {s["phase"] for s in result.steps} == {"prefill", "decode"}
    assert max(s["batch_size"] for s in result.steps if s["phase"] == "decode") <= 3


def test_continuous_gives_the_same_greedy_outputs_as_static(ckpt, workload):
    requests, prompts = workload
    static = Engine(ckpt, None, RuntimeConfig(batch_size=4)).generate(requests, prompt_ids=prompts)
    cont = Engine(ckpt, None, RuntimeConfig(batch_size=4, scheduler="continuous")).generate(requests, prompt_ids=prompts)
    assert [c.output_ids for c in cont.completions] == [c.output_ids for c in static.completions]
    # continuous keeps the batch fuller: fewer decode steps for the same tokens
    decode_steps = lambda r: sum(s["phase"] == "decode" for s in r.steps)  # noqa: E731
    assert decode_steps(cont) < decode_steps(static)


class ShuffledAdmission(admission.AdmissionPolicy):
    """Any admission order must be safe: prefill ahead, and run a random choice of the running
    requests each step (some wait with their KV in the cache, and join or rejoin later)."""

    name = "shuffled"

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def lookahead(self, batch_size):
        return 2

    def select(self, running, batch_size):
        return self.rng.sample(running, min(batch_size, len(running)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_admission_order_is_correct(ckpt, workload, alone, monkeypatch, seed):
    monkeypatch.setattr(admission, "make_admission", lambda name, batch_size: ShuffledAdmission(seed))
    requests, prompts = workload
    result = Engine(ckpt, None, RuntimeConfig(batch_size=3, scheduler="continuous")).generate(requests, prompt_ids=prompts)
    check_complete(result, workload, alone)


@pytest.mark.parametrize("policy", ["fifo", "affinity"])
def test_out_of_blocks_waits_or_preempts_and_outputs_stay_correct(ckpt, workload, alone, monkeypatch, policy):
    # 4-token blocks; the longest request needs 14; 16 blocks for 3 slots forces both back-pressure
    # (requests wait for blocks) and preemption (a running request cannot grow).
    monkeypatch.setattr(Engine, "_kv_blocks", lambda self, seqs: 16)
    requests, prompts = workload
    runtime = RuntimeConfig(batch_size=3, scheduler="continuous", kv_block_size=4, admission=policy)
    result = Engine(ckpt, None, runtime).generate(requests, prompt_ids=prompts)
    check_complete(result, workload, alone)
    ev = result.evidence["scheduler"]
    assert ev["preemptions"] > 0 and ev["readmissions"] == ev["preemptions"]
    assert min(s["batch_size"] for s in result.steps if s["phase"] == "decode") < 3  # memory, not slots, bound it


def test_equal_lengths_leave_nothing_to_admit_mid_flight_and_that_is_no_error(ckpt, workload):
    _, prompts = workload
    requests = [Request(f"e{i}", "", 5) for i in range(6)]
    runtime = RuntimeConfig(batch_size=3, scheduler="continuous", admission="fifo")
    result = Engine(ckpt, None, runtime).generate(requests, prompt_ids=prompts[:6])
    ev = result.evidence["scheduler"]
    assert ev["admissions_mid_flight"] == 0 and ev["mid_flight_opportunities"] == 0
    assert not result.activation_errors


def test_a_request_larger_than_the_cache_is_an_error_not_a_hang(ckpt, workload, monkeypatch):
    monkeypatch.setattr(Engine, "_kv_blocks", lambda self, seqs: 2)
    requests, prompts = workload
    with pytest.raises(MoebenchError, match="cannot fit"):
        Engine(ckpt, None, RuntimeConfig(batch_size=3, scheduler="continuous", kv_block_size=4)).generate(
            requests, prompt_ids=prompts)


def test_activation_needs_a_mid_flight_admission():
    assert scheduler_activation_errors("continuous", {}, 10, 4)  # not the continuous scheduler at all
    assert scheduler_activation_errors("continuous", {"admissions_mid_flight": 0}, 10, 4)
    assert scheduler_activation_errors("continuous", {"admissions_mid_flight": 0, "mid_flight_opportunities": 2}, 10, 4)
    assert not scheduler_activation_errors("continuous", {"admissions_mid_flight": 3}, 10, 4)
    # every batch ended at once (equal lengths): nothing could join mid-flight, which is no failure
    assert not scheduler_activation_errors("continuous", {"admissions_mid_flight": 0, "mid_flight_opportunities": 0}, 10, 4)
    bm = BlockManager(8, 4)
    assert isinstance(make_scheduler(RuntimeConfig(scheduler="continuous"), bm), ContinuousScheduler)
    with pytest.raises(MoebenchError, match="admission"):
        make_scheduler(RuntimeConfig(scheduler="continuous", admission="lifo"), bm)


# --- the scheduler alone, driven by a fake model whose routing is chosen by the test -------------

NUM_EXPERTS, TOP_K, LAYERS = 16, 2, 2


class FakeStats:
    def __init__(self):
        self.load = torch.zeros(LAYERS, NUM_EXPERTS)
        self.last_topk = {}


def cluster_experts(token: int) -> list[int]:
    """Routing depends on the token's cluster (token // 100): cluster c uses experts 2c and 2c+1."""
    c = token // 100
    return [2 * c % NUM_EXPERTS, (2 * c + 1) % NUM_EXPERTS]


def drive(policy: str, arrivals, batch_size: int, steps_cap: int = 2000):
    """Run the scheduler with a fake forward; `arrivals[step]` lists (id, cluster, new tokens) to add
    before that step. Returns the scheduler, distinct experts of each decode step and the step at
    which each request first decoded."""
    bm = BlockManager(1000, 4)
    sched = ContinuousScheduler(batch_size, bm, 4096, admission.make_admission(policy, batch_size))
    stats = FakeStats()
    sched.attach(stats)
    distinct, first_decode, done = [], {}, []
    for step in range(steps_cap):
        for rid, cluster, n in arrivals.get(step, []):
            sched.add(Sequence(Request(rid, "", n), [100 * cluster + 1] * 3, n, 0.0))
        if not sched.has_work():
            break
        batch = sched.schedule()
        tokens = [t for s in batch for t in s.new_token_ids]
        topk = torch.tensor([cluster_experts(t) for t in tokens])
        stats.last_topk = {layer: topk for layer in range(LAYERS)}
        if not any(s.in_prefill for s in batch):
            distinct.append(len(set(topk.flatten().tolist())))
            for s in batch:
                first_decode.setdefault(s.id, step)
        for s in batch:
            s.num_cached = s.num_tokens
            s.output_ids.append(s.prompt_ids[0])  # the sequence keeps talking in its own cluster
            if len(s.output_ids) >= s.max_new_tokens:
                sched.finish(s)
                done.append(s.id)
    assert sorted(done) == sorted(rid for reqs in arrivals.values() for rid, _, _ in reqs)
    return sched, distinct, first_decode


def test_affinity_groups_requests_that_share_experts():
    # Four clusters arriving interleaved, lengths varied: FIFO mixes them in every batch; affinity
    # should fill slots with requests of the clusters already running.
    rng = random.Random(0)
    arrivals = {0: [(f"q{i}", i % 4, rng.randint(5, 30)) for i in range(64)]}
    fifo, fifo_distinct, _ = drive("fifo", arrivals, batch_size=4)
    aff, aff_distinct, _ = drive("affinity", arrivals, batch_size=4)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(aff_distinct) < 0.8 * mean(fifo_distinct)
    assert aff.evidence()["affinity_reorders"] > 0 and fifo.evidence()["affinity_reorders"] == 0
    assert aff.evidence()["admissions_mid_flight"] > 0


def test_affinity_never_starves_a_request():
    # One request of a lone cluster among a steady stream of cluster-0 requests that the running
    # batch (all cluster 0) always prefers; the skip bound must still let it in.
    batch_size = 4
    rng = random.Random(0)
    arrivals = {0: [(f"a{i}", 0, 3 + 2 * i) for i in range(batch_size)] + [("lonely", 5, 6)]}
    for step in range(1, 400):  # requests leave one at a time, and candidates never run out
        arrivals[step] = [(f"s{step}", 0, rng.randint(4, 9))]
    sched, _, first_decode = drive("affinity", arrivals, batch_size=batch_size)
    ev = sched.evidence()
    assert ev["fairness_joins"] >= 1
    # max_skips (2 x batch size): at most that many joins of later arrivals went first
    overtaking_joins = {st for rid, st in first_decode.items() if st < first_decode["lonely"] and rid.startswith("s")}
    assert 0 < len(overtaking_joins) <= 2 * batch_size
