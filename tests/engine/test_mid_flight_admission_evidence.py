"""Continuous batching with affinity admission that prefills every request in the first step and
then rotates whole groups through the batch did run continuous batching: its evidence must say
so (it reported "no request was admitted into a running batch")."""

import torch

from moebench.engine.admission import make_admission
from moebench.engine.kv_cache import BlockManager
from moebench.engine.scheduler import ContinuousScheduler, scheduler_activation_errors
from moebench.engine.sequence import Request, Sequence

EXPERTS, LAYERS = 16, 2


def run(batch_size: int, groups: int, new_tokens: int):
    """The real scheduler and affinity policy over a forward whose routing is fixed per group:
    group g's tokens always use experts 2g and 2g+1, so the policy keeps a group together."""

    class Stats:
        load = torch.zeros(LAYERS, EXPERTS)
        last_topk = {}

    sched = ContinuousScheduler(batch_size, BlockManager(4000, 4), 4096, make_admission("affinity", batch_size))
    sched.attach(Stats)
    group_of = {}
    for g in range(groups):
        for i in range(batch_size):
            seq = Sequence(Request(f"g{g}-{i}", ""), [g + 1] * 5, new_tokens, 0.0)
            group_of[id(seq)] = g
            sched.add(seq)
    steps = []
    while sched.has_work():
        batch = sched.schedule()
        steps.append(sorted({group_of[id(s)] for s in batch}))
        rows = [[2 * group_of[id(s)], 2 * group_of[id(s)] + 1] for s in batch
                for _ in range(s.num_cached, s.num_tokens)]
        Stats.last_topk = {layer: torch.tensor(rows) for layer in range(LAYERS)}
        for s in batch:
            s.num_cached = s.num_tokens
            s.output_ids.append(0)
            if len(s.output_ids) >= s.max_new_tokens:
                sched.finish(s)
    return steps, sched.evidence()


def test_a_whole_group_rotated_into_a_paused_batch_counts_as_mid_flight():
    batch_size = 4
    steps, evidence = run(batch_size, groups=2, new_tokens=3 * batch_size)
    assert evidence["prefill_steps"] == 1  # every request prefilled in the first step
    # the workload this is about: group 0 decodes alone, then group 1 starts while group 0 is unfinished
    first_b = next(i for i, groups in enumerate(steps) if i > 0 and 1 in groups)
    assert steps[1:first_b] and all(g == [0] for g in steps[1:first_b])
    assert steps[first_b] == [1] and any(0 in g for g in steps[first_b + 1:])
    assert evidence["affinity_reorders"] > 0
    assert evidence["admissions_mid_flight"] == batch_size  # the whole of group 1 joined mid-flight
    assert scheduler_activation_errors("continuous", evidence, 2 * batch_size, batch_size) == []


def test_a_group_started_only_after_the_last_one_ended_is_not_mid_flight():
    # with no more requests than slots per group and answers shorter than the skip bound, group 1
    # waits until group 0 is done: what a static batch does too, so nothing counts
    batch_size = 4
    steps, evidence = run(batch_size, groups=2, new_tokens=2)
    assert evidence["admissions_mid_flight"] == 0
    assert steps[1] == [0] and steps[-1] == [1]
