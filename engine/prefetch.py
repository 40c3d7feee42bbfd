"""prefetch=lookahead: predict the next MoE layer's experts and load them while this layer computes.

Two predictors, unioned (a wrong guess costs a load off the critical path, a missed one costs a
load on it):
- the next layer's router applied to this layer's MoE input: the residual stream changes little
  from one layer to the next, so it picks mostly the experts that layer will really pick;
- the experts the next layer used one decode step earlier: consecutive tokens of the same
  sequences route alike. This one also covers the first MoE layer of the next step, which no
  router can see ahead of (it is planned once the last MoE layer of this step has routed).

`before_layer(L)` hands the plan to the store, which issues it right after layer L's own experts are
in place, so the loads run on a worker thread while layer L's kernel computes (see
`moebench.engine.expert_store`). Where the prediction is larger than the pool (a batch touching most
experts), the surplus is loaded into the next layer's stage rows, so prefetch still takes those
loads off the critical path.

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
        # Within a step layer L plans for the next MoE layer with that layer's router; the last MoE
        # layer plans for the first one of the next step from history alone. (With a single MoE layer
        # the next call is this very layer, whose pool is in use: nothing to plan.)
        self.next_moe = dict(zip(moe, moe[1:]))
        if len(moe) > 1:
            self.next_moe[moe[-1]] = moe[0]
        self.first = moe[0] if moe else None
        # x is rms_norm(h) * (layer L's norm weight); layer L+1's router will see rms_norm(h') * (its
        # own norm weight). Folding the ratio of the two weights into L+1's router makes the guess use
        # L+1's scaling (the per-token rms factor does not change a top-k); it is a guess, so the
        # rounding of the folded product does not matter. Not folded where a weight is ~0.
        self.routers = {}
        for a, b in zip(moe, moe[1:]):
            router = ckpt.layers[b].router
            wa, wb = ckpt.layers[a].post_attention_norm, ckpt.layers[b].post_attention_norm
            if bool((wa.abs() > 1e-6).all()) and not torch.equal(wa, wb):
                router = router * (wb / wa)
            self.routers[a] = router
        # More than top-k per token raises recall at the cost of bandwidth; fewer keeps only the
        # surest guesses (a router's top ranks are right more often than its last ones).
        self.k = max(1, min(cfg.top_k + extra_per_token, cfg.num_experts))
        self.store = store
        # With every expert resident there is nothing to load: the prefetcher stays idle.
        self.active = isinstance(store, PooledStore)
        self.last_used: dict[int, list[int]] = {}  # MoE layer -> experts its last call used
        self.plans = 0

    def before_layer(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if not self.active:
            return
        self.last_used[layer] = topk_ids.flatten().tolist()
        nxt = self.next_moe.get(layer)
        if nxt is None:
            return
        wanted = []
        if nxt != self.first:  # the router's guess first: it sees this token
            wanted = torch.topk(F.linear(x, self.routers[layer]), self.k, dim=-1).indices.flatten().tolist()
        wanted += self.last_used.get(nxt, ())
        if wanted:  # (no history yet for the first layer: no plan, and no prediction to score)
            self.store.plan_prefetch(nxt, list(dict.fromkeys(wanted)))  # distinct, in order
            self.plans += 1

    def evidence(self) -> dict:
        if not self.active:
            return {"lookahead": "idle: the expert budget keeps every expert resident, nothing to prefetch",
                    "lookahead_plans": 0}
        return {"lookahead": "next-layer router on the current hidden state, unioned with the experts the "
                             "next layer used one step earlier",
                "lookahead_plans": self.plans, "lookahead_per_token": self.k}

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
