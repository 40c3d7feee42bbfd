"""Admission policies of continuous batching: which prefilled requests join the decode batch first.

The continuous scheduler prefills waiting requests in arrival order; a prefilled request then
waits for a decode slot. The policy orders those candidates.

`fifo`: arrival order, and nothing is prefilled ahead of a free slot (nano-vllm's behaviour).

`affinity`: prefer the candidates whose experts overlap most with those the running batch is
using, so each decode step reads fewer distinct experts (MoE decoding is bound by reading expert
weights: every distinct expert in a step is one more set of matrices to stream).

What predicts a request's decode-time experts? Not its prompt's token ids: prompts of one suite
end alike, yet sequences route differently because of their context. What does predict them is
the routing the request itself had at the end of its prefill, where decoding continues from, and
then its own recent decode steps: on a random 64-expert top-8 Qwen3-MoE, a sequence's prefill-
tail experts overlap its first decode steps' by ~78%, and its decode steps overlap each other by
85-94%, against 28% between different sequences. So the policy measures instead of guessing:
the scheduler prefills up to `lookahead` requests ahead of free slots, and each sequence carries
a signature (`Sequence.routed_experts`, [layers, experts]): the mean routing of its prefill tail,
then an exponentially decayed average of its decode routing. The batch profile is the sum of
the running signatures; candidates are picked greedily, each the one whose routing falls least
on experts the profile leaves cold (expected new experts exp(-profile)), then added to it.

Fairness: a candidate passed over by a later arrival counts a skip; one with `max_skips` skips
joins next, in arrival order, whatever its affinity. Prefill stays in arrival order, so a
request's queue wait is FIFO's, and its extra wait for a decode slot is bounded by `max_skips`
joins.
"""

from __future__ import annotations

import torch

from moebench.engine.sequence import Sequence


class AdmissionPolicy:
    name = "base"

    def lookahead(self, batch_size: int) -> int:
        """How many requests to prefill ahead of free decode slots (candidates to choose from)."""
        return 0

    def order(self, candidates: list[Sequence], running: list[Sequence], slots: int) -> list[Sequence]:
        """Prefilled candidates (arrival order) in the order they should join; the scheduler takes
        the first `slots`."""
        return candidates

    def joined(self, chosen: list[Sequence], candidates: list[Sequence]) -> None:
        pass

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

    def __init__(self, max_skips: int, lookahead: int, decay: float = 0.8, tail_tokens: int = 4):
        self.num_layers = 0
        self.num_experts = 0
        self.max_skips = max_skips
        self._lookahead = lookahead
        self.decay = decay  # per decode step: a signature follows what the sequence does now
        self.tail_tokens = tail_tokens
        self.reorders = 0
        self.forced = 0
        self._skips: dict[int, int] = {}  # id(seq) -> times a later arrival joined first

    def lookahead(self, batch_size: int) -> int:
        return self._lookahead

    def attach(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts

    # learning -----------------------------------------------------------------------------------

    def observe(self, batch, lens, last_topk) -> None:
        if not last_topk or not batch or not self.num_experts:
            return
        # Only the rows that matter: the last `tail_tokens` tokens of each sequence of the step.
        rows, owners, start = [], [], 0
        for i, q in enumerate(lens):
            take = min(q, self.tail_tokens)
            rows.extend(range(start + q - take, start + q))
            owners.extend([i] * take)
            start += q
        index = torch.tensor(rows)
        sig = torch.zeros(len(batch), self.num_layers, self.num_experts)
        weight = torch.zeros(len(batch))
        owner = torch.tensor(owners)
        weight.index_add_(0, owner, torch.ones(len(owners)))
        for layer, topk in last_topk.items():
            ids = topk.index_select(0, index.to(topk.device)).cpu()  # [rows, k]
            hist = torch.zeros(len(rows), self.num_experts).scatter_(1, ids, 1.0)
            sig[:, layer].index_add_(0, owner, hist)
        sig /= weight[:, None, None]
        for seq, q, s in zip(batch, lens, sig):
            old = seq.routed_experts
            if q > 1 or old is None:  # a prefill (or recompute) starts the signature afresh
                seq.routed_experts = s
            else:
                seq.routed_experts = self.decay * old + (1 - self.decay) * s

    # choosing -----------------------------------------------------------------------------------

    def order(self, candidates, running, slots):
        if len(candidates) <= 1:
            return candidates
        forced = [s for s in candidates if self._skips.get(id(s), 0) >= self.max_skips]
        free = [s for s in candidates if self._skips.get(id(s), 0) < self.max_skips]
        profile = torch.zeros(self.num_layers, self.num_experts)
        for s in running:
            if s.routed_experts is not None:
                profile += s.routed_experts
        known = [s for s in free if s.routed_experts is not None]
        unknown = [s for s in free if s.routed_experts is None]
        picked: list[Sequence] = []
        if known:
            sigs = torch.stack([s.routed_experts for s in known])  # [n, layers, experts]
            left = torch.ones(len(known), dtype=torch.bool)
            while left.any() and len(forced) + len(picked) < slots:
                # expected new experts: each candidate's routing mass on experts the profile leaves cold
                costs = (sigs * torch.exp(-profile)).sum(dim=(1, 2)).masked_fill(~left, float("inf"))
                best = int(torch.argmin(costs))  # ties: the earliest arrival (candidates are in arrival order)
                left[best] = False
                picked.append(known[best])
                profile += sigs[best]
            known = [s for s, still in zip(known, left.tolist()) if still]
        return forced + picked + known + unknown

    def joined(self, chosen, candidates) -> None:
        taken = {id(s) for s in chosen}
        last = max(i for i, s in enumerate(candidates) if id(s) in taken)
        if any(id(s) not in taken for s in candidates[: len(chosen)]):
            self.reorders += 1
        for i, s in enumerate(candidates):
            if id(s) in taken:
                if self._skips.pop(id(s), 0) >= self.max_skips:
                    self.forced += 1
            elif i < last:
                self._skips[id(s)] = self._skips.get(id(s), 0) + 1

    def evidence(self) -> dict:
        return {"admission": self.name, "affinity_reorders": self.reorders, "fairness_joins": self.forced}


def make_admission(name: str, batch_size: int) -> AdmissionPolicy:
    from moebench.errors import MoebenchError

    if name == "fifo":
        return FifoAdmission()
    if name == "affinity":
        return AffinityAdmission(max_skips=2 * batch_size, lookahead=batch_size)
    raise MoebenchError(f"unknown admission '{name}' (choose from: affinity, fifo)")
