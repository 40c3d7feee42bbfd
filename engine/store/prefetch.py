"""prefetch=lookahead: predict the next MoE layer's experts and load them before that layer routes.

The guess is the next MoE layer's own router applied to the residual stream as it stands when the
guess is made; what is still to come before that router runs is one attention update, so it picks
mostly what the layer will pick:
- after MoE layer L has added its output (`after_layer`): layer L+1's router on that stream, and
  the loads overlap layer L+1's attention;
- at the start of a forward (`before_forward`): the first MoE layer's router on the embeddings, and
  the loads overlap the attention of the layers before it;
- earlier, unless `early` is off (`before_layer`, the early guess): layer L+1's router on layer L's
  MoE input, before layer L's MoE, so the loads overlap that MoE too (a disk read, or a layer's copies
  of MB-sized experts, outlasts one attention). The late guess then adds what the early one missed.

How well each guess predicts, measured against other designs, is in docs/prefetch.md.

RMSNorm divides each token by its own rms, a positive number that does not change which experts
come top, so the guess is top-k of (router * norm weight) @ h, one matmul. A wrong guess costs
bandwidth, never correctness: `fetch` still loads whatever it needs and is missing, cancels
predicted loads that have not started, and waits for any it needs that are still in flight (stall).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from moebench.engine.store.expert_store import PooledStore, host_ids
from moebench.kernels.reference import route_grouped_sigmoid


class PlanGovernor:
    """Decides at run time whether predicting pays, by measuring both: it alternates a window of
    `window` plans with predictions on and a window of as many skipped plans (predictions off, misses
    loaded on demand as with prefetch=off), and compares what each cost the model's thread per expert
    look-up: with predictions, the time spent guessing and issuing plus the stall (waiting for loads
    in flight, loading what was missed); without, the stall. The cheaper mode then runs for `keep`
    windows before the other is measured again. So where loads are cheap (the host tier on a CPU, small
    experts) or prefetches only crowd a saturated disk, it stops predicting, and it starts again
    when that changes. Kernel time is the same in both modes and is left out of the comparison."""

    def __init__(self, store, window: int = 48, keep: int = 8, enabled: bool = True):
        self.store, self.window, self.keep, self.enabled = store, window, keep, enabled
        self.predicting = True
        self.left = window  # plans left in this window (counted whether made or skipped)
        self.probe = True  # a short window measuring its mode against the other (else a kept stretch)
        self.cost = {True: None, False: None}  # last measured cost per look-up (s), by mode
        self.pauses = self.resumes = self.skipped = 0
        self.last = None
        self._start_window()

    def _start_window(self) -> None:
        t = self.store.counters.total
        self.plan_s, self.stall0, self.lookups0 = 0.0, t["stall_s"], t["lookups"]

    def should_plan(self) -> bool:
        if self.enabled and self.left <= 0:
            self._next_window()
        self.left -= 1
        if not self.predicting:
            self.skipped += 1
        return self.predicting

    def planned(self, seconds: float) -> None:
        self.plan_s += seconds

    def _next_window(self) -> None:
        t = self.store.counters.total
        lookups = t["lookups"] - self.lookups0
        if lookups:  # every window measures its mode afresh, kept stretches too
            self.cost[self.predicting] = (t["stall_s"] - self.stall0 + self.plan_s) / lookups
        on, off = self.cost[True], self.cost[False]
        if off is None:  # the first window measured predictions: now measure without
            mode, self.probe, windows = False, True, 1
        elif self.probe:  # both measured: keep the cheaper one for a while
            mode, self.probe, windows = on <= off, False, self.keep
            self.last = {"us_per_lookup_predicting": round(on * 1e6, 3),
                         "us_per_lookup_not_predicting": round(off * 1e6, 3), "predicting": mode}
        else:  # a kept stretch ended: measure the other mode again
            mode, self.probe, windows = not self.predicting, True, 1
        if mode != self.predicting:
            self.pauses += not mode
            self.resumes += mode
        self.predicting = mode
        self.left = self.window * windows
        self._start_window()

    def evidence(self) -> dict:
        return {"lookahead_governor": self.enabled, "lookahead_pauses": self.pauses,
                "lookahead_resumes": self.resumes, "lookahead_skipped_plans": self.skipped,
                "lookahead_last_decision": self.last}


class LookaheadPrefetcher:
    name = "lookahead"

    def __init__(self, ckpt, store, extra_per_token: int = 1, early: bool = False, governor: dict | None = None):
        cfg = ckpt.config
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        self.first = moe[0] if moe else None
        self.next_moe = dict(zip(moe, moe[1:]))  # the last MoE layer has none within the forward
        # router rows scaled by the layer's post-attention norm weight (see the module docstring)
        self.routers = {i: ckpt.layers[i].router * ckpt.layers[i].post_attention_norm for i in moe}
        # Early guesses (slow tiers): layer L+1's router on layer L's MoE input x = h * w_L / rms(h),
        # so its rows are scaled by w_{L+1} / w_L (by w_{L+1} alone where w_L has zeros).
        self.early_routers = {}
        for a, b in zip(moe, moe[1:]) if early else ():
            wa = ckpt.layers[a].post_attention_norm
            self.early_routers[a] = self.routers[b] / wa if bool((wa.abs() > 1e-6).all()) else self.routers[b]
        # A guess one rank deeper than top-k per token raises recall far more than it costs in
        # loads; the first layer, guessed from bare embeddings, gets one rank more.
        self.k = max(1, min(cfg.top_k + extra_per_token, cfg.num_experts))
        self.k_first = min(self.k + 1, cfg.num_experts)
        self.store = store
        # One native call per guess where the extension is built (see `guess_experts`), routers
        # transposed for it; torch ops otherwise.
        self._guess = None
        if all(r.device.type == "cpu" and r.dtype == torch.float32 for r in self.routers.values()):
            from moebench.kernels.expert_loader import load_extension

            ext = load_extension()
            if ext is not None:
                self._guess = ext.guess_experts
                self.routers = {i: r.t().contiguous() for i, r in self.routers.items()}
                self.early_routers = {i: r.t().contiguous() for i, r in self.early_routers.items()}
        # With every expert resident there is nothing to load: the prefetcher stays idle.
        self.active = isinstance(store, PooledStore) and bool(moe)
        self.plans = 0
        self.governor = PlanGovernor(store, **(governor or {})) if self.active else None
        # Grouped sigmoid routers (Ling-3.0) are guessed by their own routing, bias and groups included
        self.grouped = GroupedRouterGuess(ckpt) if GroupedRouterGuess.applies(ckpt) else None

    def _experts(self, h: torch.Tensor, router: torch.Tensor, k: int) -> list[int]:
        """Distinct top-k experts of h @ router over h's tokens, in token order."""
        if self._guess is not None:  # router transposed
            return self._guess(h if h.dtype == torch.float32 else h.float(), router, k)
        ids = host_ids(torch.topk(F.linear(h, router), k, dim=-1).indices)
        return list(dict.fromkeys(ids.ravel().tolist()))

    def _plan(self, layer: int, h: torch.Tensor, router: torch.Tensor, k: int, normed_by: int | None = None) -> None:
        """`normed_by`: h is that layer's MoE input (the early guess), not the residual stream."""
        if not self.governor.should_plan():
            return
        t0 = time.perf_counter()
        guess = self.grouped(layer, h, normed_by, k) if self.grouped else self._experts(h, router, k)
        self.store.prefetch(layer, guess)
        self.plans += 1
        self.governor.planned(time.perf_counter() - t0)

    def before_forward(self, h: torch.Tensor) -> None:
        if self.active:
            self._plan(self.first, h, self.routers[self.first], self.k_first)

    def before_layer(self, layer: int, x: torch.Tensor) -> None:
        router = self.early_routers.get(layer)
        if self.active and router is not None:
            self._plan(self.next_moe[layer], x, router, self.k, normed_by=layer)

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        nxt = self.next_moe.get(layer)
        if self.active and nxt is not None:
            self._plan(nxt, h, self.routers[nxt], self.k)

    def evidence(self) -> dict:
        if not self.active:
            return {"lookahead": "idle: the expert budget keeps every expert resident, nothing to prefetch",
                    "lookahead_plans": 0}
        return {"lookahead": "each MoE layer's router on the residual stream before that layer's attention "
                             "(the first MoE layer's on the embeddings)",
                "lookahead_plans": self.plans, "lookahead_per_token": self.k,
                "lookahead_per_token_first_layer": self.k_first,
                "lookahead_early": bool(self.early_routers), **self.governor.evidence(),
                "lookahead_router": "grouped sigmoid (bias, groups)" if self.grouped else "top-k of router logits"}

    def activation_errors(self, store) -> list[str]:
        from moebench.engine.store.expert_store import store_activation_errors

        if not self.active:
            budget = store.evidence().get("expert_budget")
            return [f"prefetch=lookahead with expert budget {budget}: every expert is resident, so there is "
                    "nothing to prefetch; set --expert-budget below 1 (for example 0.5) to measure prefetch"]
        ev = store.evidence()
        errors = store_activation_errors(store)
        if ev["prefetch_hits"] == 0:
            errors.append(
                f"prefetch=lookahead with expert budget {ev['expert_budget']}: {ev['prefetch_issued']} "
                f"prefetches issued over {self.plans} plans and none was used by the layer it was loaded for"
            )
        return errors


class GroupedRouterGuess:
    """prefetch=lookahead's guess for grouped sigmoid routers: the next MoE layer's own routing
    (sigmoid, expert bias, group limit, top-k) applied to the residual stream as it stands. Ranking
    plain router logits, as for a softmax router, ignores the bias and the groups, which both change
    the choice; RMSNorm's per-token scale does not cancel under a sigmoid plus a bias, so the stream
    is normalised first. The early guess gets layer L's MoE input x = w_L * h / rms(h): x / w_L has
    the stream's direction, and RMSNorm does not see the scale."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.cfg = ckpt.config

    @staticmethod
    def applies(ckpt) -> bool:
        return any(getattr(layer, "expert_bias", None) is not None for layer in ckpt.layers)

    def __call__(self, layer: int, stream: torch.Tensor, normed_by: int | None, k: int) -> list[int]:
        """Distinct experts, in token order, of the top-k per token of MoE layer `layer`'s router on
        `stream` (the residual stream, or with `normed_by` the MoE input of that layer)."""

        cfg, w = self.cfg, self.ckpt.layers[layer]
        z = stream.float()
        if normed_by is not None:
            scale = self.ckpt.layers[normed_by].post_attention_norm.float()
            if bool((scale.abs() > 1e-6).all()):
                z = z / scale
        norm = w.post_attention_norm.float()
        y = F.rms_norm(z, norm.shape, norm, cfg.rms_norm_eps)  # z is float32: model.rms_norm's one op
        _, ids = route_grouped_sigmoid(F.linear(y, w.router), w.expert_bias, min(k, cfg.num_experts), cfg.n_group,
                                       cfg.topk_group, False, 1.0)
        return list(dict.fromkeys(host_ids(ids).ravel().tolist()))
