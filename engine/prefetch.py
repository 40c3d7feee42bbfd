"""prefetch=lookahead: predict the next MoE layer's experts and load them while this layer computes.

The residual stream changes little from one layer to the next, so the next layer's router applied to
this layer's MoE input picks mostly the experts that layer will really pick. In `before_layer(L)`
the prefetcher runs router L+1 on x (a [tokens, E] matmul, tiny next to the experts' work), takes
the top-k per token, ranks the union by how many tokens chose each expert, and hands that plan to
the store. The store issues it right after layer L's own experts are in place, so the loads run on
worker threads while layer L's kernel computes, and evicts experts neither predicted nor recently
used to make room.

A wrong prediction costs bandwidth, never correctness: `fetch(L+1)` still loads whatever it needs
and is missing, cancels predicted loads that have not started, and waits for any it needs that are
still in flight (that wait is counted as stall).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebench.engine.expert_store import PooledStore


class LookaheadPrefetcher:
    name = "lookahead"

    def __init__(self, ckpt, store, extra_per_token: int = 0):
        cfg = ckpt.config
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        self.next_moe = dict(zip(moe, moe[1:]))
        self.routers = {i: ckpt.layers[i].router for i in moe}
        # x is rms_norm(h) * (layer L's norm weight); layer L+1's router will see rms_norm(h') * (its
        # own norm weight). Swapping the weights makes the guess use L+1's scaling (the per-token
        # rms factor does not change a top-k). Skipped where a weight is ~0 and cannot be divided out.
        self.rescale = {}
        for a, b in self.next_moe.items():
            wa, wb = ckpt.layers[a].post_attention_norm, ckpt.layers[b].post_attention_norm
            if bool((wa.abs() > 1e-6).all()) and not torch.equal(wa, wb):
                self.rescale[a] = wb / wa
        self.num_experts = cfg.num_experts
        # More than top-k per token raises recall at the cost of bandwidth; fewer keeps only the
        # surest guesses (a router's top ranks are right more often than its last ones).
        self.k = max(1, min(cfg.top_k + extra_per_token, cfg.num_experts))
        self.store = store
        # With every expert resident there is nothing to load: the prefetcher stays idle.
        self.active = isinstance(store, PooledStore)
        self.plans = 0

    def before_layer(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if not self.active:
            return
        nxt = self.next_moe.get(layer)
        if nxt is None:
            return
        if layer in self.rescale:
            x = x * self.rescale[layer]
        logits = F.linear(x, self.routers[nxt])  # softmax is monotonic: top-k of logits = top-k of probs
        ids = torch.topk(logits, self.k, dim=-1).indices
        votes = torch.bincount(ids.flatten(), minlength=self.num_experts)
        order = torch.argsort(votes, descending=True, stable=True)
        wanted = order[: int((votes > 0).sum())].tolist()
        self.store.plan_prefetch(nxt, wanted)
        self.plans += 1

    def evidence(self) -> dict:
        if not self.active:
            return {"lookahead": "idle: the expert budget keeps every expert resident, nothing to prefetch",
                    "lookahead_plans": 0}
        return {"lookahead": "next-layer router on the current hidden state", "lookahead_plans": self.plans,
                "lookahead_per_token": self.k}

    def activation_errors(self, store) -> list[str]:
        if not self.active:
            return []
        ev = store.evidence()
        if ev["prefetch_hits"] == 0:
            return [
                f"prefetch=lookahead with expert budget {ev['expert_budget']}: {ev['prefetch_issued']} "
                f"prefetches issued over {self.plans} plans and none was used by the layer it was loaded for"
            ]
        return []
