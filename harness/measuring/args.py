"""A run's arguments, typed (vLLM's EngineArgs pattern): made once from the command line or from a
resumed run's manifest, checked and given their defaults here, one place for each, and written to the
manifest as they are (`to_dict`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from moebench.errors import MoebenchError

# the bundled synthetic suite's default size: the default job takes minutes, not an hour
BUNDLED_SUITE_LIMIT = 200


@dataclass(frozen=True)
class RunArgs:
    model: str | None = None  # a checkpoint directory (None: the suite's bundled model)
    suite: str = "gsm-synth"
    data: str | None = None
    limit: int | None = None  # None: every item; BUNDLED_SUITE_LIMIT for the bundled gsm-synth
    num_fewshot: int | None = None
    kernel: str = "naive"
    scheduler: str = "static"
    prefetch: str = "off"
    ablate: bool = False
    factorial: bool = False
    axes: str | None = None
    lm_head: str | None = None
    weights: str = "f32"
    approximate_stacked: bool = False
    repeats: int | None = None  # None: 3 with --ablate, else 1
    warmup: int = 4
    batch_size: int = 16
    max_new_tokens: int = 256
    expert_budget: str | None = None  # None: the run's own default (measuring/run.py _budget_text)
    offload_tier: str = "auto"
    admission: str = "affinity"
    decode_path: str = "auto"
    device: str = "cpu"
    threads: int | None = None  # None: 1 for the bundled runtime on the CPU (README), else torch's own
    seed: int = 0
    negative_control: str | None = None
    engine: str = "bundled"
    base_url: str | None = None
    profiles: str | None = None
    profile: tuple[str, ...] | None = None
    served_model: str | None = None
    tokenizer: str | None = None
    chat: bool = False
    concurrency: int = 16
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    speculative: str = "off"
    spec_tokens: int = 4
    spec_max_batch: int | None = None
    request_timeout: float = 600.0
    # offered load (moebench.measuring.arrivals): None everywhere is the closed loop
    request_rate: str | None = None
    burstiness: float = 1.0
    fluctuate: str | None = None
    arrivals: str | None = None
    slo: tuple[str, ...] | None = None  # "ttft=0.5", "tpot=0.05", "e2e=10" (seconds)

    def __post_init__(self):
        # the defaults that depend on other arguments, resolved once, here
        if self.repeats is None:
            object.__setattr__(self, "repeats", 3 if self.ablate else 1)
        if self.limit is None and self.suite == "gsm-synth":
            object.__setattr__(self, "limit", BUNDLED_SUITE_LIMIT)
        if self.threads is None and self.device == "cpu" and self.engine == "bundled":
            object.__setattr__(self, "threads", 1)
        object.__setattr__(self, "profile", tuple(self.profile) if self.profile else None)
        object.__setattr__(self, "slo", tuple(self.slo) if self.slo else None)
        self.loads()  # an unusable load or SLO is refused before anything starts
        self.slos()
        if self.repeats < 1:
            raise MoebenchError(f"--repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise MoebenchError(f"--warmup must be >= 0 (0 skips the warm-up), got {self.warmup}")
        if self.threads is not None and self.threads < 0:
            raise MoebenchError(f"--threads must be >= 0, got {self.threads}")
        if self.factorial and not self.ablate:
            raise MoebenchError("--factorial needs --ablate")

    def loads(self):
        """The offered loads, in the order each trial runs them (moebench.measuring.arrivals.Load);
        None: the closed loop, every request queued at the start, as without these options."""
        from moebench.measuring.arrivals import loads_from_args

        return loads_from_args(self.request_rate, self.burstiness, self.fluctuate, self.arrivals)

    def slos(self) -> dict[str, float]:
        """The latency SLOs a request must meet to count in goodput, seconds by metric."""
        from moebench.measuring.arrivals import parse_slos

        return parse_slos(self.slo or ())

    @classmethod
    def from_dict(cls, d: dict) -> "RunArgs":
        """A manifest's `args` (a run being resumed, or an older run's): keys this version does not know
        are dropped, and keys an older run lacks take their defaults, as when that run started."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["profile"] = list(self.profile) if self.profile else None
        d["slo"] = list(self.slo) if self.slo else None
        return d
