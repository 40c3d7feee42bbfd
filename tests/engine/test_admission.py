"""Affinity admission: the fast paths (batched routing -> masks, vectorised-by-list greedy choice,
index bookkeeping in `select`) must make exactly the choices of a plain implementation of the
policy: same batches, same tie-breaking (earliest arrival), same fairness bound, same evidence."""

import random

import pytest
import torch

from moebench.engine.admission import (AdmissionPolicy, AffinityAdmission, greedy_fewest_new,
                                       greedy_fewest_new_reference, make_admission)
from moebench.engine.kv_cache import BlockManager
from moebench.engine.scheduler import ContinuousScheduler
from moebench.engine.sequence import Request, Sequence


def seq(i: int) -> Sequence:
    return Sequence(Request(f"r{i}", ""), [1, 2, 3], 8, 0.0)


def random_mask(rng: random.Random, nbits: int, density: float) -> int:
    return sum(1 << b for b in range(nbits) if rng.random() < density)


# --- the greedy choice -------------------------------------------------------------------------


@pytest.mark.parametrize("nbits", [1, 8, 63, 64, 65, 128, 512])
def test_greedy_matches_the_plain_greedy_on_random_masks(nbits):
    rng = random.Random(nbits)
    for _ in range(400):
        n = rng.randint(0, 50)
        density = rng.choice([0.02, 0.1, 0.3, 0.8])
        masks = [random_mask(rng, nbits, density) for _ in range(n)]
        if masks and rng.random() < 0.3:  # duplicates and empty masks: ties
            masks[rng.randrange(n)] = masks[rng.randrange(n)]
            masks[rng.randrange(n)] = 0
        used = random_mask(rng, nbits, 0.1) if rng.random() < 0.5 else 0
        slots = rng.randint(-1, 20)
        assert greedy_fewest_new(masks, slots, used) == greedy_fewest_new_reference(masks, slots, used)


def test_greedy_breaks_ties_by_index_and_counts_only_new_bits():
    # all add 2 bits at first: index 0; then 0b0011 adds nothing new for index 2, 0b1100 adds 2
    assert greedy_fewest_new([0b0011, 0b1100, 0b0011, 0b0110], 2) == [0, 2]
    # with used, 0b1100 adds nothing
    assert greedy_fewest_new([0b0011, 0b1100, 0b0110], 1, used=0b1100) == [1]
    # all zero-cost candidates at once, in index order, then the cheapest of the rest
    assert greedy_fewest_new([0b1, 0b10, 0b1, 0b111, 0b11], 4, used=0b1) == [0, 1, 2, 4]


# --- observe: routing of a step -> each sequence's (layer, expert) bits ---------------------------


def plain_observe(batch, lens, last_topk, num_experts):
    """The plain definition: bit i * num_experts + e for expert e of the i-th MoE layer (sorted) that
    the sequence's last token of the step used."""
    ends = [sum(lens[: j + 1]) - 1 for j in range(len(lens))]
    layers = sorted(last_topk)
    out = []
    for end in ends:
        mask = 0
        for i, layer in enumerate(layers):
            for e in last_topk[layer][end].tolist():
                mask |= 1 << (i * num_experts + e)
        out.append(mask)
    return out


@pytest.mark.parametrize("layers,experts,k",
                         [(4, 16, 2), (2, 16, 2), (8, 64, 8), (3, 7, 7), (48, 128, 4), (2, 4096, 3)])
def test_observe_sets_the_last_tokens_layer_expert_bits(layers, experts, k):
    rng = random.Random(layers * experts + k)
    torch.manual_seed(0)
    policy = AffinityAdmission(max_skips=4, lookahead=8)
    policy.attach(layers + 1, experts)
    moe_layers = [1 + 2 * i for i in range(layers)]  # not 0..L-1: the bits follow the sorted order
    for step in range(12):
        n = rng.randint(1, 9)
        prefill = step % 3 == 0
        lens = [rng.randint(1, 6) for _ in range(n)] if prefill else [1] * n
        topk = {layer: torch.stack([torch.randperm(experts)[:k] for _ in range(sum(lens))]) for layer in moe_layers}
        batch = [seq(i) for i in range(n)]
        policy.observe(batch, lens if prefill else None, topk)
        assert [s.routed_experts for s in batch] == plain_observe(batch, lens, topk, experts)


# --- select: the whole per-step choice, over many steps ------------------------------------------


class PlainAffinity:
    """The policy written plainly: forced requests (skipped max_skips steps in a row) first, then one
    at a time the known request adding the fewest (layer, expert) pairs to those already in the batch
    (ties: earliest arrival), then requests without routing yet while slots are left."""

    def __init__(self, max_skips):
        self.max_skips = max_skips
        self.skips = {}
        self.reorders = 0
        self.forced = 0

    def select(self, running, batch_size):
        if len(running) <= batch_size:
            self.skips = {}
            return list(running)
        forced = [s for s in running if self.skips.get(s.id, 0) >= self.max_skips][:batch_size]
        self.forced += len(forced)
        rest = [s for s in running if s not in forced]
        known = [s for s in rest if s.routed_experts is not None]
        unknown = [s for s in rest if s.routed_experts is None]
        used = 0
        for s in forced:
            used |= s.routed_experts or 0
        picked = []
        for _ in range(min(batch_size - len(forced), len(known))):
            best = min(known, key=lambda s: bin(s.routed_experts & ~used).count("1"))
            known.remove(best)
            used |= best.routed_experts
            picked.append(best)
        chosen = forced + picked + unknown[: max(batch_size - len(forced) - len(picked), 0)]
        batch = [s for s in running if s in chosen]
        if batch != running[: len(batch)]:
            self.reorders += 1
        self.skips = {s.id: self.skips.get(s.id, 0) + 1 for s in running if s not in chosen}
        return batch


@pytest.mark.parametrize("batch_size,nbits,clusters", [(4, 64, 4), (16, 64, 0), (8, 512, 6), (3, 12, 2)])
def test_select_makes_the_plain_policys_choices_step_after_step(batch_size, nbits, clusters):
    rng = random.Random(batch_size * 1000 + nbits)
    fast, plain = make_admission("affinity", batch_size), PlainAffinity(max_skips=batch_size)
    running, next_id, batches = [], 0, 0
    for step in range(600):
        # arrivals (routing unknown until their prefill is observed), departures
        for _ in range(rng.randint(0, 3)):
            if len(running) < 3 * batch_size:
                running.append(seq(next_id))
                next_id += 1
        for s in list(running):
            if rng.random() < 0.05:
                running.remove(s)
        if not running:
            continue
        fast_batch = fast.select(list(running), batch_size)
        plain_batch = plain.select(list(running), batch_size)
        assert [s.id for s in fast_batch] == [s.id for s in plain_batch], f"step {step}"
        batches += len(running) > batch_size
        # the step's routing: clustered (requests that route alike) or random
        for s in running:
            if s in fast_batch or s.routed_experts is None and rng.random() < 0.5:
                if clusters:
                    c = (int(s.id[1:]) + step // 50) % clusters
                    bits = [(c * 7 + j * 3 + rng.randint(0, 1)) % nbits for j in range(6)]
                    s.routed_experts = sum({1 << b for b in bits})
                else:
                    s.routed_experts = random_mask(rng, nbits, 8 / nbits)
    assert batches > 100
    assert fast.evidence()["affinity_reorders"] == plain.reorders > 0
    assert fast.evidence()["fairness_joins"] == plain.forced > 0


def test_select_with_no_more_running_than_slots_runs_them_all_and_forgets_skips():
    policy = make_admission("affinity", 2)
    a, b, c = seq(0), seq(1), seq(2)
    a.routed_experts, b.routed_experts, c.routed_experts = 0b1100, 0b0011, 0b1100
    assert policy.select([a, b, c], 2) == [a, c]  # b skipped once
    assert policy.select([a, b], 2) == [a, b]
    assert policy.select([a, b, c], 2) == [a, c]  # b's skip count started over
    assert policy.evidence()["fairness_joins"] == 0


class PlainAffinityPolicy(AdmissionPolicy):
    """PlainAffinity behind the scheduler's policy interface, learning routing with plain_observe."""

    name = "affinity"

    def __init__(self, batch_size):
        self.plain = PlainAffinity(max_skips=batch_size)
        self.batch_size = batch_size

    def lookahead(self, batch_size):
        return 2 * batch_size

    def attach(self, num_layers, num_experts):
        self.num_experts = num_experts

    def observe(self, batch, lens, last_topk):
        lens = lens or [1] * len(batch)
        for s, mask in zip(batch, plain_observe(batch, lens, last_topk, self.num_experts)):
            s.routed_experts = mask

    def select(self, running, batch_size):
        return self.plain.select(running, batch_size)

    def evidence(self):
        return {"admission": self.name, "affinity_reorders": self.plain.reorders, "fairness_joins": self.plain.forced}


def run_scheduler(policy, batch_size, requests, experts=16, layers=3, k=2):
    """The continuous scheduler over a fake forward whose routing depends on each request's cluster
    and position in its answer; returns the request ids of every step and the evidence."""

    class Stats:
        load = torch.zeros(layers, experts)
        last_topk = {}

    sched = ContinuousScheduler(batch_size, BlockManager(4000, 4), 64, policy)
    sched.attach(Stats)
    for rid, cluster, n in requests:
        sched.add(Sequence(Request(rid, ""), [cluster] * (3 + cluster % 5), n, 0.0))
    steps = []
    while sched.has_work():
        batch = sched.schedule()
        steps.append([s.id for s in batch])
        rows = []
        for s in batch:
            for t in range(s.num_cached, s.num_tokens):
                phase = (t // 4 + s.prompt_ids[0]) % experts
                rows.append([(phase + j * 5) % experts for j in range(k)])
        topk = torch.tensor(rows)
        Stats.last_topk = {2 * layer: (topk + layer) % experts for layer in range(layers)}
        for s in batch:
            s.num_cached = s.num_tokens
            s.output_ids.append(0)
            if len(s.output_ids) >= s.max_new_tokens:
                sched.finish(s)
    return steps, sched.evidence()


def test_scheduler_with_the_fast_policy_runs_the_plain_policys_batches():
    rng = random.Random(7)
    requests = [(f"q{i}", rng.randint(0, 9), rng.randint(2, 40)) for i in range(120)]
    fast_steps, fast_ev = run_scheduler(make_admission("affinity", 8), 8, requests)
    plain_steps, plain_ev = run_scheduler(PlainAffinityPolicy(8), 8, requests)
    assert fast_steps == plain_steps
    assert fast_ev == plain_ev
    assert fast_ev["affinity_reorders"] > 0 and fast_ev["admissions_mid_flight"] > 0
