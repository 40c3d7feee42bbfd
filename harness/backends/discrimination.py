"""Evidence that discriminates: a piece of evidence proves a configuration only if it does not
also hold for the configuration it is compared with, the baseline.

A log line every server of the engine prints (SGLang's one-line `server_args={...}` dump names
`enable_fp32_lm_head` and `fp8_gemm_runner_backend` whatever is switched on) or an endpoint field
with the same value in both proves nothing: a switch the server silently ignored would pass.
So every must-match item of every non-baseline configuration is judged against the baseline's
own observation as well; one that holds there is refused, unless the profile marks it
`shared = true` on purpose (a readiness line, say), and a configuration needs at least one item
that the baseline fails. The same rule for the bundled runtime's switches: the checks a switched-on
configuration passes must fail on the baseline's evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moebench.backends.evidence import MustItem, Observation, item_holds, must_items
from moebench.backends.profiles import Profile
from moebench.errors import ActivationError, MoebenchError


@dataclass
class Verdict:
    """One configuration's must-match evidence, judged against the baseline's observation."""

    profile: Profile
    proving: list[MustItem] = field(default_factory=list)  # fails for the baseline
    shared: list[tuple[MustItem, object]] = field(default_factory=list)  # marked shared
    refused: list[tuple[MustItem, object]] = field(default_factory=list)  # holds for the baseline, not marked

    @property
    def ok(self) -> bool:
        return not self.refused and bool(self.proving)

    def problem(self, baseline: str) -> str | None:
        """The first reason this configuration's evidence cannot tell it from the baseline."""
        if self.refused:
            item, seen = self.refused[0]
            more = f" (and {len(self.refused) - 1} more)" if len(self.refused) > 1 else ""
            return (f"profile '{self.profile.name}': evidence {item.label} also holds for the baseline "
                    f"'{baseline}' (there: {_short(seen)}){more}, so it cannot tell the two apart; "
                    f"narrow it, or mark it shared = true if that is intended")
        if not self.proving:
            return (f"profile '{self.profile.name}' has no evidence that the baseline '{baseline}' lacks "
                    f"(every must-match item is shared or there is none)")
        return None


def _short(seen) -> str:
    text = repr(seen)
    return text if len(text) <= 100 else text[:97] + "..."


def judge(profile: Profile, baseline: Observation) -> Verdict:
    verdict = Verdict(profile)
    for item in must_items(profile.evidence):
        holds, seen = item_holds(item, baseline)
        if item.shared:
            verdict.shared.append((item, seen))
        elif holds:
            verdict.refused.append((item, seen))
        else:
            verdict.proving.append(item)
    return verdict


def observed_paths(profiles) -> dict[str, set[str]]:
    """The endpoint paths the given configurations' evidence reads, per moment: what the
    baseline's server must also be asked, to judge that evidence against it."""
    paths: dict[str, set[str]] = {"start": set(), "end": set()}
    for profile in profiles:
        for check in profile.evidence.endpoints:
            paths[check.when].add(check.path)
    return paths


def refuse_non_discriminating(source: Path | str, baseline: Profile, others, observation: Observation) -> None:
    """One line naming the profile file and entry whose evidence also holds for the baseline."""
    for profile in others:
        problem = judge(profile, observation).problem(baseline.name)
        if problem:
            raise MoebenchError(f"{source}: {problem}")


# ----------------------------------------------------------------- the bundled runtime

def _switch_checks(num_requests: int, batch_size: int) -> dict:
    """Per switch, the must-match check of each value that has one (the errors it finds in an
    evidence dict; none means the check holds). A value without one (static, off) proves
    nothing of its own and is not judged."""
    from moebench.engine.moe import kernel_activation_errors
    from moebench.engine.scheduler import scheduler_activation_errors

    def prefetch_used(evidence: dict) -> list[str]:
        hits = (evidence.get("prefetch") or {}).get("prefetch_hits", 0)
        return [] if hits > 0 else ["no prefetched expert was used"]

    return {
        "kernel": {
            "fused": lambda ev: kernel_activation_errors("fused", ev.get("kernel") or {}),
            "naive": lambda ev: kernel_activation_errors("naive", ev.get("kernel") or {}),
        },
        "scheduler": {
            "continuous": lambda ev: scheduler_activation_errors(
                "continuous", ev.get("scheduler") or {}, num_requests, batch_size),
        },
        "prefetch": {"lookahead": prefetch_used},
    }


def bundled_problems(configs, evidence: dict, num_requests: int, batch_size: int) -> list[str]:
    """For each configuration after the first (the baseline), each switch it sets differently
    whose check would pass on the baseline's evidence too. `evidence` maps config names to the
    evidence their warm-up left."""
    if not configs:
        return []
    base = configs[0]
    base_ev = evidence.get(base.name) or {}
    checks = _switch_checks(num_requests, batch_size)
    problems = []
    for cfg in configs[1:]:
        for switch, by_value in checks.items():
            value = getattr(cfg, switch, None)
            if value == getattr(base, switch, None) or value not in by_value:
                continue
            own = by_value[value](evidence.get(cfg.name) or {})
            if own:
                continue  # its own check failed: the activation check reports that
            if switch == "scheduler" and _not_exercised(cfg, evidence.get(cfg.name) or {}, num_requests, batch_size):
                continue  # nothing to prove in this workload; the summary says "not exercised"
            if not by_value[value](base_ev):
                problems.append(f"config '{cfg.name}': the evidence of {switch}={value} holds for the baseline "
                                f"'{base.name}' too, so it cannot tell the two apart")
    return problems


def _not_exercised(cfg, evidence: dict, num_requests: int, batch_size: int) -> bool:
    from moebench.engine.scheduler import scheduler_not_exercised

    return bool(scheduler_not_exercised(cfg.scheduler, evidence.get("scheduler") or {}, num_requests, batch_size))


def refuse_bundled_non_discriminating(configs, evidence: dict, num_requests: int, batch_size: int) -> None:
    problems = bundled_problems(configs, evidence, num_requests, batch_size)
    if problems:
        raise ActivationError("; ".join(problems))
