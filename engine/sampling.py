"""Token selection under sampling: temperature, top-k and top-p, with one reproducible draw per
output position.

A request's tokens must not depend on what else ran beside it (batch size and composition, the
scheduler, a preemption and recompute, which kernel ran), so nothing here keeps state between
steps: the uniform number behind a request's token at output position n is a pure function of
(the request's seed, n), a counter-based generator (SplitMix64's finalizer applied twice), and each
row is reduced to a token by itself, from its own logits alone.

The rule for one row with temperature t > 0:
  1. weights w = exp((logit - max logit) / t), in float32;
  2. the kept set: the top_k largest logits (ties broken by the lower token id), then, of those in
     that order, the shortest prefix whose weight reaches top_p of the kept weight (at least one);
  3. inverse CDF: the kept tokens walked in token-id order, their weights summed in float64 (by
     blocks of 256, see _Running), and the first token whose running sum exceeds u * total, u in
     [0, 1) the position's uniform.
Walking in token-id order (not sorted by probability) keeps the unfiltered case free of a sort of
the vocabulary. Temperature 0 is greedy and draws nothing (the engine keeps its argmax path).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from moebench.errors import MoebenchError

SAMPLER = "inverse-cdf in token-id order over the top-k/top-p set; uniform = splitmix64(splitmix64(seed) ^ position)"
SEED_DERIVATION = "sha256('{run_seed}:{trial}:{item_id}'), first 8 bytes big-endian, >> 1 (a 63-bit seed)"
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0: greedy. top_k None: no cut by count;
    top_p 1: no cut by mass. seed: the request's own stream (64 bits are used)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0
    # temperature 0: worked out once here, not on every step that asks (the engine's token selection)
    greedy: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.top_p is None:
            raise MoebenchError("top-p must be a number in (0, 1] (1: no cut)")
        check_sampling(self.temperature, self.top_p, self.top_k)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise MoebenchError(f"a sampling seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "greedy", self.temperature == 0)

    def setting(self) -> tuple:
        """What the sampler applied, without the seed (the evidence groups positions by it)."""
        return (float(self.temperature), float(self.top_p), self.top_k)


def check_sampling(temperature: float, top_p: float | None, top_k: int | None, what: str = "") -> None:
    """Refuse settings no sampler can honour (one line, exit 2 at the command line)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise MoebenchError(f"{what}temperature must be a finite number >= 0, got {temperature!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not (0 < top_p <= 1)):
        raise MoebenchError(f"{what}top-p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise MoebenchError(f"{what}top-k must be an integer >= 1 (or unset), got {top_k!r}")


def check_sampling_options(temperature: float, top_p: float | None, top_k: int | None) -> None:
    """Refuse what no engine can honour: a bad value (the sampler's own check), or a top-p / top-k cut
    beside greedy decoding (which would be recorded and silently ignored)."""
    check_sampling(temperature, top_p, top_k, "--")
    if temperature == 0 and (top_p not in (None, 1) or top_k is not None):
        raise MoebenchError("--top-p and --top-k need --temperature > 0 (greedy decoding would ignore them)")


GREEDY = SamplingParams()


def request_seed(run_seed: int, trial: int, item_id: str) -> int:
    """A request's seed from (run seed, trial, item id): configurations stay paired item by item
    whatever order or batch their requests run in, and each trial draws new samples. 63 bits, so
    it fits the signed 64-bit seed field of OpenAI-compatible servers."""
    digest = hashlib.sha256(f"{run_seed}:{trial}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of output position `position` of the stream `seed` (53 bits)."""
    return (_splitmix64(_splitmix64(seed & MASK64) ^ position) >> 11) * (1.0 / (1 << 53))


def _largest(row, n: int):
    """Indices of the n largest values of `row` in the order (value descending, index ascending)."""
    import numpy as np

    size = row.shape[0]
    if n >= size:
        idx = np.arange(size)
    else:  # every value tied with the n-th largest, so the set depends on the values alone
        kth = np.partition(row, size - n)[size - n]
        idx = np.flatnonzero(row >= kth)
    return idx[np.lexsort((idx, -row[idx]))][:n]


class _Running:
    """The running sum of float32 weights in float64, for finding where it crosses a target without
    a sequential pass over the whole vocabulary (a cumsum of 32000 costs ~0.5 ms, 16 rows a step):
    blocks of 256 summed at once, then a running sum inside the one block that crosses."""

    BLOCK = 256

    def __init__(self, w):
        import numpy as np

        self.w = w
        n = w.shape[0]
        if n <= 4 * self.BLOCK:  # short: one plain running sum is cheaper than the blocks
            self.blocks, self.cum = None, np.cumsum(w, dtype=np.float64)
        else:
            pad = (-n) % self.BLOCK
            self.blocks = (np.concatenate([w, np.zeros(pad, w.dtype)]) if pad else w).reshape(-1, self.BLOCK)
            self.cum = np.cumsum(self.blocks.sum(axis=1, dtype=np.float64))
        self.total = float(self.cum[-1])

    def first(self, target: float, reaching: bool) -> int:
        """The first index whose running sum exceeds `target` (reaches it, if `reaching`)."""
        import numpy as np

        side = "left" if reaching else "right"
        n = self.w.shape[0]
        b = int(np.searchsorted(self.cum, target, side=side))
        if self.blocks is None:
            if b < n:
                return b
        elif b < len(self.cum):
            run = (self.cum[b - 1] if b else 0.0) + np.cumsum(self.blocks[b], dtype=np.float64)
            j = b * self.BLOCK + int(np.searchsorted(run, target, side=side))
            if j < min((b + 1) * self.BLOCK, n):
                return j
            n = min((b + 1) * self.BLOCK, n)  # the block's two sums rounded apart: its last weighted token
        weighted = np.flatnonzero(self.w[:n] > 0)
        return int(weighted[-1]) if len(weighted) else n - 1


def sample_row(row, params: SamplingParams, u: float) -> int:
    """One token from one row of float32 logits (see the module's rule)."""
    import numpy as np

    top = row.max()
    if not np.isfinite(top):
        raise MoebenchError(f"cannot sample from logits whose largest value is {top} (the model produced "
                            "non-finite logits)")
    t = np.float32(params.temperature)
    size = row.shape[0]
    k = size if params.top_k is None else min(params.top_k, size)
    if params.top_p >= 1:
        kept = None if k == size else np.sort(_largest(row, k))
    elif k < size:
        order = _largest(row, k)
        ordered = np.exp((row[order] - top) / t)
        run = _Running(ordered)
        kept = np.sort(order[: run.first(params.top_p * run.total, reaching=True) + 1])
    else:  # the nucleus of the whole vocabulary: a sort of the values, not of (value, index) pairs
        values = np.sort(row)[::-1]
        run = _Running(np.exp((values - top) / t))
        cut = run.first(params.top_p * run.total, reaching=True)
        above = np.flatnonzero(row > values[cut])
        tied = np.flatnonzero(row == values[cut])[: cut + 1 - len(above)]  # lower token ids first
        kept = np.sort(np.concatenate([above, tied]))
    w = np.exp(((row if kept is None else row[kept]) - top) / t)
    run = _Running(w)
    pick = run.first(u * run.total, reaching=False)
    return pick if kept is None else int(kept[pick])


def choose_tokens(logits, params: list[SamplingParams], positions: list[int], counts: dict | None = None) -> list[int]:
    """Each row's next token, the one place tokens are chosen (a plain step's and a speculative
    verify step's rows alike): the plain argmax when every row is greedy (the fast path; which each
    request's params fixed when they were made), else one draw per sampling row at its output
    position (`positions`). `counts` (a session's evidence) gets the positions drawn and those chosen
    greedily, and the settings drawn with."""
    if all(p.greedy for p in params):
        ids, drawn = greedy_token_ids(logits), 0
    else:
        ids, drawn = sample_token_ids(logits, params, positions)
        if counts is not None:
            for setting in {p.setting() for p in params if not p.greedy}:
                counts["settings"].add(setting)
    if counts is not None:
        counts["sampled_positions"] += drawn
        counts["greedy_positions"] += len(params) - drawn
    return ids


def greedy_token_ids(logits) -> list[int]:
    """Each row's first index of its largest logit (a NaN counts as largest), as torch's argmax. On the
    CPU numpy's argmax gives the same index several times faster (32000 logits: ~30 us against ~110
    us; 16 rows: ~0.1 ms against ~1.4 ms), and it runs once per decode step."""
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample_token_ids(logits, params: list[SamplingParams], positions: list[int]) -> tuple[list[int], int]:
    """Each row's token: greedy rows their first largest logit (as torch's argmax), the others one
    draw each at their output position. Returns the tokens and how many rows drew."""
    import torch

    rows = logits.detach().to("cpu", torch.float32).numpy()
    out, drawn = [], 0
    for row, p, position in zip(rows, params, positions):
        if p.greedy:
            out.append(int(row.argmax()))
        else:
            out.append(sample_row(row, p, uniform(p.seed, position)))
            drawn += 1
    return out, drawn


def sampling_activation_errors(wanted: SamplingParams | None, evidence: dict | None) -> list[str]:
    """A run asked for sampling: the engine's own count of the positions it drew, and the settings
    it drew with, must show it (a temperature that never reached the sampler is an error, not a
    greedy result). Evidence without a sampling block (another engine) is not judged here."""
    if wanted is None or wanted.greedy or not isinstance(evidence, dict) or "sampling" not in evidence:
        return []
    seen = evidence["sampling"]
    if not seen.get("sampled_positions"):
        return [f"sampling: temperature {wanted.temperature} was asked for but the engine drew no token "
                f"({seen.get('greedy_positions', 0)} positions were greedy)"]
    settings = [tuple(s) for s in seen.get("settings", [])]
    if settings != [wanted.setting()]:
        return [f"sampling: asked for (temperature, top_p, top_k) = {wanted.setting()}, the engine "
                f"applied {settings}"]
    return []


def describe_sampling(wanted: SamplingParams) -> dict:
    """The manifest's record of how tokens were chosen and how each request's seed was made."""
    if wanted.greedy:
        return {"mode": "greedy", "temperature": 0.0}
    return {"mode": "sampling", "temperature": wanted.temperature, "top_p": wanted.top_p, "top_k": wanted.top_k,
            "run_seed": wanted.seed, "sampler": SAMPLER, "seed_derivation": SEED_DERIVATION}
