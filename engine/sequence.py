"""A request and its life in the engine: waiting -> running -> finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moebench.engine.sampling import GREEDY, SamplingParams


@dataclass
class Request:
    id: str
    prompt: str
    max_new_tokens: int | None = None  # None: the runtime's default
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = GREEDY  # temperature 0: greedy; else the request's own seeded stream


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    prompt_ids: list[int]
    max_new_tokens: int
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds since arrival, one per output token
    routed_experts: int | None = None  # bit layer * experts + e set per expert e its latest token used (affinity)
    scheduled_s: float | None = None  # open loop: when it was due, seconds from the start (engine/open_loop.py)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def new_token_ids(self) -> list[int]:
        return self.all_ids[self.num_cached:]

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
