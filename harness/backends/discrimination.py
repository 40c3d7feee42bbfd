"""Evidence that discriminates: a piece of evidence proves an optimization of a configuration only
if no configuration of the profile that lacks that optimization shows it too.

A log line every server of the engine prints (SGLang's one-line `server_args={...}` dump names
`enable_fp32_lm_head` and `fp8_gemm_runner_backend` whatever is switched on) or an endpoint field
with the same value in both proves nothing: a switch the server silently ignored would pass. And a
stacked configuration (cuda-graphs+prefix-cache+fp8-kv) inherits the evidence of its predecessors:
that evidence proves the predecessors' optimizations, never the one the step adds. So each
must-match item of a configuration is judged against the observation of every other configuration
and attributed to the optimizations it can prove: those it fails for wherever they are off. An item
attributed to none is refused, unless the profile marks it `shared = true` on purpose (a readiness
line, a setting kept from the baseline). Each optimization a configuration enables needs an item
of its own, and at least one of kind "runtime" (a counter, a log line, a value that changes only
when it ran): an optimization proved by echo alone (the server repeating its arguments) is refused
unless the profile marks the configuration `echo_only = true` with its reason. The same rule for
the bundled runtime's switches: the checks a switched-on configuration passes must fail on the
baseline's evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moebench.backends.evidence import MustItem, Observation, item_holds, must_items
from moebench.backends.profiles import Profile
from moebench.errors import ActivationError, MoebenchError


@dataclass
class Verdict:
    """One configuration's must-match evidence, judged against the other configurations'
    observations."""

    profile: Profile
    baseline: str
    proofs: dict = field(default_factory=dict)  # optimization -> the items that prove it
    shared: list = field(default_factory=list)  # (item, seen on the baseline): marked shared
    refused: list = field(default_factory=list)  # (item, the config it also holds for, seen there)

    @property
    def proving(self) -> list[MustItem]:
        return list(dict.fromkeys(i for items in self.proofs.values() for i in items))

    @property
    def unproved(self) -> list[str]:
        return [o for o in self.profile.enables if not self.proofs.get(o)]

    @property
    def echo_proved(self) -> list[str]:
        """Optimizations whose only proof is the server repeating its arguments."""
        return [o for o in self.profile.enables
                if self.proofs.get(o) and all(i.kind == "echo" for i in self.proofs[o])]

    @property
    def ok(self) -> bool:
        return self.problem() is None

    def _where(self, other: str) -> str:
        return f"the baseline '{other}'" if other == self.baseline else f"'{other}'"

    def problem(self) -> str | None:
        """The first reason this configuration's evidence cannot stand as its proof."""
        name = self.profile.name
        if self.refused:
            item, other, seen = self.refused[0]
            more = f" (and {len(self.refused) - 1} more)" if len(self.refused) > 1 else ""
            return (f"profile '{name}': evidence {item.label} also holds for {self._where(other)} "
                    f"(there: {_short(seen)}){more}, so it cannot tell the two apart; "
                    f"narrow it, or mark it shared = true if that is intended")
        if self.unproved:
            missing = self.unproved[0]
            if not self.proving:
                return (f"profile '{name}' has no evidence that the baseline '{self.baseline}' lacks "
                        f"(every must-match item is shared or there is none)")
            return (f"profile '{name}' has no evidence of {missing!r} that the configurations without it "
                    f"lack (what it shows proves {', '.join(o for o in self.profile.enables if o != missing)})")
        echo = self.echo_proved
        if echo and not self.profile.echo_only:
            labels = "; ".join(i.label for i in self.proofs[echo[0]])
            return (f"profile '{name}': {echo[0]!r} is proved only by the server repeating its arguments "
                    f"(echo: {labels}); add runtime evidence (a counter, a log line or a value that changes "
                    f"only when it ran), or mark the profile echo_only = true with echo_only_reason")
        if self.profile.echo_only and not echo:
            return (f"profile '{name}' is marked echo_only, yet every optimization it enables has runtime "
                    f"evidence; drop echo_only and echo_only_reason")
        return None


def _short(seen) -> str:
    text = repr(seen)
    return text if len(text) <= 100 else text[:97] + "..."


def judge(profile: Profile, observations: dict[str, Observation], profiles, baseline: str) -> Verdict:
    """`observations`: what each other configuration's server showed (by name; the baseline's at
    least). An item proves optimization O when it fails for every observed configuration without
    O; where it proves several, those it also holds for wherever they are on are kept (MTP's
    acceptance line fails on the server that has only the MoE runner, so it proves MTP, not the
    runner)."""
    verdict = Verdict(profile, baseline)
    enables = {p.name: set(p.enables) for p in profiles}
    others = [n for n in observations if n != profile.name and n in enables]
    for item in must_items(profile.evidence):
        holds_for = {n: item_holds(item, observations[n]) for n in others}
        if item.shared:
            verdict.shared.append((item, holds_for.get(baseline, (False, None))[1]))
            continue
        candidates = [item.proves] if item.proves else profile.enables
        proves = [o for o in candidates
                  if not any(holds_for[n][0] for n in others if o not in enables[n])]
        consistent = [o for o in proves if all(holds_for[n][0] for n in others if o in enables[n])]
        if not proves:
            # name the configuration it cannot be told from: the baseline first
            other = next(n for n in sorted(others, key=lambda n: n != baseline) if holds_for[n][0])
            verdict.refused.append((item, other, holds_for[other][1]))
            continue
        for o in consistent or proves:
            verdict.proofs.setdefault(o, []).append(item)
    return verdict


def observed_paths(profiles) -> dict[str, set[str]]:
    """The endpoint paths the given configurations' evidence reads, per moment: what every
    other configuration's server must also be asked, to judge that evidence against it."""
    paths: dict[str, set[str]] = {"start": set(), "end": set()}
    for profile in profiles:
        for check in profile.evidence.endpoints:
            paths[check.when].add(check.path)
    return paths


def refuse_non_discriminating(source: Path | str, baseline: Profile, others, observations) -> None:
    """One line naming the profile file and the entry whose evidence cannot prove it.
    `observations`: an Observation of the baseline, or a dict of them by configuration name."""
    if isinstance(observations, Observation):
        observations = {baseline.name: observations}
    profiles = [baseline, *others]
    for profile in others:
        problem = judge(profile, observations, profiles, baseline.name).problem()
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
