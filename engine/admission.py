"""Admission policies of continuous batching: which running requests make up each decode step.

The continuous scheduler prefills waiting requests in arrival order and keeps every prefilled,
unfinished request's KV in the cache (`running`); before every decode step the policy picks the
`batch_size` of them that run. With no more running requests than slots there is no choice.

`fifo`: nothing is prefilled ahead of a free slot, so every running request runs (nano-vllm's
behaviour).

`affinity`: up to `lookahead` requests are prefilled ahead, and each step runs the requests whose
next token is expected to use experts the others use too, so the step reads fewer distinct experts
(MoE decoding is bound by reading expert weights: every distinct expert in a step is one more set
of matrices to stream).

What predicts the experts of a request's next token? Its previous token's: routing follows the
context, which changes by one token a step. Measured on recorded routing (the bundled model on
gsm-synth; a random 64-expert top-8 Qwen3-MoE on GSM8K), a sequence's consecutive decode steps
share most of their experts, far more than two sequences at the same step do. Requests started
together (a static batch) are at the same point of their answers and so route alike; continuous
batching mixes requests at every point of their answers, which is why its full batches touch more
distinct experts than static ones do. Choosing, each step, among more requests than slots lets
the batch regroup requests that currently route alike.

Choice: each running request carries the (layer, expert) pairs of its last token
(`Sequence.routed_experts`, set from the step's routing). Greedily, the batch takes the request
that adds the fewest (layer, expert) pairs the batch does not use yet; ties go to the earliest
arrival. Fairness: a running request left out of a step counts a skip; at `max_skips` consecutive
skips it runs next step whatever its experts, so no request waits more than `max_skips` steps for a
decode step. Prefill stays in arrival order, so a request's queue wait (to its first compute) is
FIFO's or shorter (it is prefilled ahead).
"""

from __future__ import annotations

import torch

from moebench.engine.sequence import Sequence


class AdmissionPolicy:
    name = "base"

    def lookahead(self, batch_size: int) -> int:
        """How many requests to prefill beyond the batch size (candidates to choose from)."""
        return 0

    def select(self, running: list[Sequence], batch_size: int) -> list[Sequence]:
        """The requests of the next decode step: at most `batch_size` of `running` (arrival order)."""
        return running[:batch_size]

    def attach(self, num_layers: int, num_experts: int) -> None:
        """The model's shape, once the engine hands the scheduler its routing statistics."""

    def observe(self, batch: list[Sequence], lens: list[int] | None, last_topk: dict) -> None:
        """Routing of the step just run: `last_topk[layer]` holds [sum(lens), top_k] expert ids,
        the `lens[0]` tokens of `batch[0]` first; `lens` None: one token per sequence (a decode step)."""

    def evidence(self) -> dict:
        return {"admission": self.name, "affinity_reorders": 0}


class FifoAdmission(AdmissionPolicy):
    name = "fifo"


class AffinityAdmission(AdmissionPolicy):
    name = "affinity"

    def __init__(self, max_skips: int, lookahead: int):
        self.num_experts = 0
        self.max_skips = max_skips
        self._lookahead = lookahead
        self.reorders = 0  # steps whose batch differs from the first batch_size in arrival order
        self.forced = 0  # requests run because of the skip bound
        self._skips: dict[int, int] = {}  # id(seq) -> consecutive steps left out
        self._layers: list = []  # MoE layers of last_topk, sorted
        self._tables: list[list[int]] | None = None  # see _bit_tables

    def lookahead(self, batch_size: int) -> int:
        return self._lookahead

    def attach(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts

    def observe(self, batch, lens, last_topk) -> None:
        """Each sequence's `routed_experts`: bit `i * num_experts + e` set for every expert e that its
        last token of the step used in the i-th MoE layer. One tensor call per layer (`tolist`, on a
        [tokens, k] tensor), then a table lookup and an OR per (layer, expert) pair."""
        if not last_topk or not batch:
            return
        if len(self._layers) != len(last_topk):  # the MoE layers of the model (keys are never removed)
            self._layers = sorted(last_topk)
            self._tables = None
        first = last_topk[self._layers[0]]
        if first.shape[0] != len(batch):  # a prefill: each sequence's last token of the step, picked
            # before the tolist (a prefill's thousands of rows as Python ints took ~4 ms a step
            # on a 64-expert top-8 model, and the decode step after it paid for them)
            last = torch.tensor(lens).cumsum(0) - 1
            per_layer = [last_topk[layer].index_select(0, last.to(first.device)).tolist() for layer in self._layers]
        else:
            per_layer = [last_topk[layer].tolist() for layer in self._layers]  # [tokens][k] each
        if self._tables is None:
            self._tables = self._bit_tables()
        if self._tables:
            masks = [0] * len(batch)
            for table, rows in zip(self._tables, per_layer):
                for i, experts in enumerate(rows):
                    mask = masks[i]
                    for e in experts:
                        mask |= table[e]
                    masks[i] = mask
        else:  # too many pairs for tables of ints: set the bits in byte arrays
            E = self.num_experts
            bufs = [bytearray(-(-len(self._layers) * E // 8)) for _ in batch]
            for layer, rows in enumerate(per_layer):
                for buf, experts in zip(bufs, rows):
                    for e in experts:
                        p = layer * E + e
                        buf[p >> 3] |= 1 << (p & 7)
            masks = [int.from_bytes(buf, "little") for buf in bufs]
        for seq, mask in zip(batch, masks):
            seq.routed_experts = mask

    def _bit_tables(self) -> list[list[int]]:
        """Per MoE layer i, the table expert e -> 1 << (i * num_experts + e); empty when the tables
        would be big (each int has up to layers * experts bits)."""
        E, L = self.num_experts, len(self._layers)
        if L * E > 4096:
            return []
        return [[1 << (i * E + e) for e in range(E)] for i in range(L)]

    def select(self, running, batch_size):
        n = len(running)
        if n <= batch_size:
            self._skips.clear()
            return list(running)
        keys = list(map(id, running))  # by identity: Sequence == compares contents
        get = self._skips.get
        skips = [get(key, 0) for key in keys]
        masks = [s.routed_experts for s in running]
        forced = [i for i, c in enumerate(skips) if c >= self.max_skips][:batch_size] \
            if max(skips) >= self.max_skips else []
        self.forced += len(forced)
        used = 0
        for i in forced:
            used |= masks[i] or 0
        slots = batch_size - len(forced)
        if forced or None in masks:
            is_forced = set(forced)
            known = [i for i in range(n) if i not in is_forced and masks[i] is not None]
            # requests without routing yet run only when slots are left
            unknown = [i for i in range(n) if i not in is_forced and masks[i] is None]
            picked = [known[j] for j in greedy_fewest_new([masks[i] for i in known], slots, used)]
        else:  # the common case: every running request is a candidate
            unknown = []
            picked = greedy_fewest_new(masks, slots, used)
        chosen = forced + picked + unknown[: max(slots - len(picked), 0)]
        chosen.sort()  # arrival order
        if chosen[-1] != len(chosen) - 1:  # not the first len(chosen) in arrival order
            self.reorders += 1
        taken = bytearray(n)
        for i in chosen:
            taken[i] = 1
        self._skips = {keys[i]: skips[i] + 1 for i in range(n) if not taken[i]}
        return [running[i] for i in chosen]

    def evidence(self) -> dict:
        return {"admission": self.name, "affinity_reorders": self.reorders, "fairness_joins": self.forced}


def greedy_fewest_new(masks: list[int], slots: int, used: int = 0) -> list[int]:
    """Indices (ascending) of `min(slots, len(masks))` masks, picked one at a time: each the one adding
    the fewest bits to `used` and the masks picked before it; ties go to the lowest index.

    Each pick is one list comprehension over the candidates left (AND, popcount), `min` and
    `list.index` (the first minimum: the tie rule). A pick adding no bit leaves every cost as it was,
    so a run of them takes the zero-cost candidates in index order at once. Plain Python on purpose:
    measured inside the engine, right after a forward pass, a numpy version of this loop was 4x
    slower than offline (its code and data cold in cache and TLB), this one 1.2x."""
    n = min(max(slots, 0), len(masks))
    if n == 0 or n == len(masks):
        return list(range(n))
    left = list(range(len(masks)))  # candidates not picked, ascending
    work = list(masks)
    free = ~used
    costs = [(m & free).bit_count() for m in work]
    picked: list[int] = []
    while True:
        cost = min(costs)
        if cost == 0:  # `free` stays as it is: every zero-cost candidate, in index order
            zeros = [j for j, c in enumerate(costs) if c == 0]
            picked += [left[j] for j in zeros[: n - len(picked)]]
            if len(picked) == n:
                break
            keep = [j for j, c in enumerate(costs) if c]
            left, work, costs = [left[j] for j in keep], [work[j] for j in keep], [costs[j] for j in keep]
            continue
        j = costs.index(cost)
        picked.append(left[j])
        if len(picked) == n:
            break
        free &= ~work[j]
        del left[j], work[j]
        costs = [(m & free).bit_count() for m in work]
    picked.sort()
    return picked


def greedy_fewest_new_reference(masks: list[int], slots: int, used: int = 0) -> list[int]:
    """The same choice, written plainly (the specification `greedy_fewest_new` is tested against)."""
    left = list(range(len(masks)))
    picked = []
    for _ in range(min(max(slots, 0), len(masks))):
        best = min(left, key=lambda i: (masks[i] & ~used).bit_count())  # ties: lowest index
        left.remove(best)
        used |= masks[best]
        picked.append(best)
    return sorted(picked)


def make_admission(name: str, batch_size: int) -> AdmissionPolicy:
    from moebench.errors import MoebenchError

    if name == "fifo":
        return FifoAdmission()
    if name == "affinity":
        return AffinityAdmission(max_skips=batch_size, lookahead=2 * batch_size)
    raise MoebenchError(f"unknown admission '{name}' (choose from: affinity, fifo)")
