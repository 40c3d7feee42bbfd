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

    def observe(self, batch: list[Sequence], lens: list[int], last_topk: dict) -> None:
        """Routing of the step just run: `last_topk[layer]` holds [sum(lens), top_k] expert ids,
        the `lens[0]` tokens of `batch[0]` first."""

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

    def lookahead(self, batch_size: int) -> int:
        return self._lookahead

    def attach(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts

    def observe(self, batch, lens, last_topk) -> None:
        if not last_topk or not batch:
            return
        last = torch.tensor(lens).cumsum(0) - 1  # each sequence's last token in the step
        ids = torch.stack([last_topk[layer].index_select(0, last.to(last_topk[layer].device)).cpu()
                           for layer in sorted(last_topk)], dim=1)  # [B, moe layers, k]
        # (layer, expert) pairs as bits of a Python int: the choice below is then a few hundred
        # integer ANDs and popcounts per step, far cheaper than tensor calls on tiny tensors.
        pairs = ids + torch.arange(ids.shape[1])[None, :, None] * self.num_experts
        for seq, row in zip(batch, pairs.flatten(1).tolist()):
            mask = 0
            for bit in row:
                mask |= 1 << bit
            seq.routed_experts = mask

    def select(self, running, batch_size):
        if len(running) <= batch_size:
            self._skips.clear()
            return list(running)
        forced = [s for s in running if self._skips.get(id(s), 0) >= self.max_skips][:batch_size]
        self.forced += len(forced)
        chosen = self._greedy([s for s in running if all(s is not f for f in forced)],
                              batch_size - len(forced), forced)
        rank = {id(s): i for i, s in enumerate(running)}  # by identity: Sequence == compares contents
        batch = sorted(forced + chosen, key=lambda s: rank[id(s)])
        if any(a is not b for a, b in zip(batch, running)):
            self.reorders += 1
        taken = {id(s) for s in batch}
        self._skips = {id(s): self._skips.get(id(s), 0) + 1 for s in running if id(s) not in taken}
        return batch

    def _greedy(self, candidates: list[Sequence], slots: int, chosen: list[Sequence]) -> list[Sequence]:
        """`slots` candidates, each the one adding the fewest (layer, expert) pairs to those of
        `chosen` and the ones picked before it."""
        known = [s for s in candidates if s.routed_experts is not None]
        unknown = [s for s in candidates if s.routed_experts is None]  # run only when slots are left
        used = 0
        for s in chosen:
            used |= s.routed_experts or 0
        picked = []
        for _ in range(min(max(slots, 0), len(known))):
            best = min(known, key=lambda s: (s.routed_experts & ~used).bit_count())  # ties: earliest arrival
            known = [s for s in known if s is not best]
            used |= best.routed_experts
            picked.append(best)
        return picked + unknown[: max(slots - len(picked), 0)]

    def evidence(self) -> dict:
        return {"admission": self.name, "affinity_reorders": self.reorders, "fairness_joins": self.forced}


def make_admission(name: str, batch_size: int) -> AdmissionPolicy:
    from moebench.errors import MoebenchError

    if name == "fifo":
        return FifoAdmission()
    if name == "affinity":
        return AffinityAdmission(max_skips=batch_size, lookahead=2 * batch_size)
    raise MoebenchError(f"unknown admission '{name}' (choose from: affinity, fifo)")
