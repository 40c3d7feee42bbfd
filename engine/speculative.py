"""Speculative decoding: draft K tokens per sequence, verify them in one forward, keep the longest
verified prefix.

A verify step feeds a decoding sequence its last token plus its K draft tokens (q_len = K + 1, the
multi-token path chunked prefill already runs over the paged KV cache) and reads the logits of
all K + 1 positions. Row j holds the target distribution p_j of output position n + j (n: the
sequence's output length before the step) given the drafts before it. The engine then picks, row by
row, the token it would have picked without speculation at that position (engine/sampling.py: the
argmax, or the position's own draw), accepts drafts while the pick equals the draft, and emits the
accepted drafts plus the first pick that differed (or the bonus pick after all K).

Why that is the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) and not an
approximation of it: a prompt-lookup draft is one token d, a point mass q = delta_d. The rule
accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise draws from norm(max(0, p - q)),
which is p without d, renormalized. Drawing t ~ p and accepting iff t == d does exactly that: t == d
has probability p(d), and given t != d, t is distributed as p without d. So every emitted token is
distributed as p, and, because t is the draw plain sampling makes at that position (the same
uniform, a pure function of (seed, position)), a sequence's tokens under speculation are the ones
it gets without speculation whenever the verify forward's logits equal the plain step's. No draw is
keyed by step, batch row or draft length: the uniform of output position n is
uniform(request seed, n) whether n is emitted by a plain step, as an accepted draft or as the
correction after a rejection; rejected positions' picks are discarded and the same position is
picked again, from the same uniform, by the next step. The MTP drafter (engine/mtp.py) proposes its
head's argmax, a point mass too, so the rule is exact for it as well; a drafter with a
non-degenerate q (sampling from a draft model) would need the general rule with a second uniform
per position; none is built.

Rollback: the K/V of rejected drafts were written to cache slots past the kept length. The
sequence's `num_cached` advances by the kept tokens only, so those slots are outside its context
(attention masks by context length) and the next step overwrites them; blocks wholly past the
kept length go back to the block manager at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.engine.runner import StepPlan
from moebench.engine.sampling import choose_tokens
from moebench.errors import MoebenchError

METHODS = ("off", "ngram", "mtp")
# The batch-size policy when --spec-max-batch is not given, measured on the bundled model
# (docs/speculative.md, "Policy"): an ngram verify step costs more plain steps than the tokens it
# emits at every batch above 1; an MTP step pays at batch 16 too (None: any batch size).
DEFAULT_MAX_BATCH = {"ngram": 1, "mtp": None}
MAX_NGRAM = 3  # the longest suffix looked up; then shorter ones down to 1
VERIFY_FORWARD = "one decode forward whose rows are each verifying sequence's last token and drafts"


@dataclass(frozen=True)
class SpecSettings:
    method: str = "off"
    tokens: int = 4  # K, drafts per sequence and verify step
    max_batch: int | None = None  # speculation off in steps with more sequences than this (None: never off)
    max_batch_by_default: bool = False  # the method's DEFAULT_MAX_BATCH, not --spec-max-batch

    def __post_init__(self):
        check_spec(self.method, self.tokens, self.max_batch)

    @property
    def on(self) -> bool:
        return self.method != "off"

    def to_dict(self) -> dict:
        if not self.on:
            return {"method": "off"}
        return {"method": self.method, "tokens": self.tokens, "max_batch": self.max_batch,
                "max_batch_from": "the method's default" if self.max_batch_by_default else "--spec-max-batch",
                "policy": "no drafts in a step of more than max_batch sequences (None: any batch size)",
                "verify_forward": VERIFY_FORWARD,
                "acceptance": "pick each position as plain decoding would (argmax, or the draw of (seed, "
                              "position)) and accept drafts while pick == draft: the speculative-sampling "
                              "rule for a point-mass draft"}


def check_spec(method: str, tokens: int, max_batch: int | None) -> None:
    if method not in METHODS:
        raise MoebenchError(f"unknown speculative method '{method}' (choose from: {', '.join(METHODS)})")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 16:
        raise MoebenchError(f"--spec-tokens must be an integer in 1..16, got {tokens!r}")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise MoebenchError(f"--spec-max-batch must be an integer >= 1 (or unset), got {max_batch!r}")


def draft_context_reads(num_cached: int, drafts: int) -> int:
    """Context tokens a verifying sequence's draft rows read besides its last token's row: draft row j
    (1..drafts) attends to num_cached + j + 1 positions."""
    return drafts * (num_cached + 1) + drafts * (drafts + 1) // 2


def ngram_draft(ids: list[int], k: int, max_n: int = MAX_NGRAM) -> list[int]:
    """Prompt-lookup drafting: the longest suffix of `ids` (max_n tokens down to 1) that occurred
    earlier in `ids`, at its most recent earlier occurrence, proposes the (up to k) tokens that
    followed it there. [] when no suffix recurs."""
    size = len(ids)
    for n in range(min(max_n, size - 1), 0, -1):
        pattern = ids[size - n:]
        first = pattern[0]
        # most recent occurrence first: recent context predicts the continuation best
        for i in range(size - n - 1, -1, -1):
            if ids[i] == first and ids[i:i + n] == pattern:
                return ids[i + n:i + n + k]
    return []


class NgramDrafter:
    """Prompt lookup (`ngram_draft`) for each sequence that may draft. The drafter interface
    (engine/mtp.py's MtpDrafter is the other): `propose(seqs, limits, block_manager)` -> (drafts,
    drafts cut for KV room), `observe(...)` after a step where `wants_hidden`, and `evidence()`."""

    name = "ngram"
    wants_hidden = False

    def propose(self, seqs, limits: list[int], block_manager) -> tuple[list[list[int]], int]:
        return [ngram_draft(seq.prompt_ids + seq.output_ids, k) if k > 0 else [] for seq, k in zip(seqs, limits)], 0

    def observe(self, *args) -> None:
        pass

    @staticmethod
    def evidence() -> dict:
        return {"drafter": "ngram"}


class Speculator:
    """The strategy of one session, one interface the step calls three times: which sequences draft
    and the forward's rows (`plan`), which tokens each emits (`select`), what the step leaves behind
    (`settle`: rejected drafts' room back, the drafter's view of the kept positions); and the evidence
    of all three, counted where they ran."""

    def __init__(self, settings: SpecSettings, drafter=None):
        self.settings = settings
        self.drafter = drafter if drafter is not None else NgramDrafter()
        k = settings.tokens
        self.verify_steps = 0  # steps with at least one draft
        self.plain_decode_steps = 0  # decode steps without a draft (none found, or the batch policy)
        self.off_by_batch = 0  # steps the batch-size policy kept plain
        self.no_room = 0  # drafts cut because the KV cache had no free block for them
        self.drafted = 0
        self.accepted = 0
        self.verified_sequences = 0  # (sequence, verify step) pairs with a draft
        self.emitted_by_verify = 0  # tokens those pairs emitted (accepted + one)
        self.drafted_at = [0] * k  # drafts proposed at draft position j
        self.accepted_at = [0] * k  # ... and accepted
        self.accepted_hist = [0] * (k + 1)  # verified sequences by how many drafts they kept
        self._step = {"drafted": 0, "accepted": 0, "accepted_lengths": []}

    def plan(self, seqs, new_tokens: list[list[int]], block_manager) -> StepPlan:
        """The step's plan (engine/runner.py StepPlan): each sequence's drafts this step ([] for none),
        with KV capacity for them already in its block table, and the forward's rows. Only decoding
        sequences draft; the last draft position leaves room for the pick after it within
        max_new_tokens. The drafter sees every step (an MTP head catches up on the positions the last
        step kept even when nothing is drafted)."""
        s = self.settings
        self._step = {"drafted": 0, "accepted": 0, "accepted_lengths": []}
        off = s.max_batch is not None and len(seqs) > s.max_batch
        if off:
            self.off_by_batch += 1
        limits = []
        for seq, tokens in zip(seqs, new_tokens):
            room = seq.max_new_tokens - len(seq.output_ids) - 1
            limits.append(0 if off or seq.in_prefill or len(tokens) != 1 or room <= 0 else min(s.tokens, room))
        drafts, cut = self.drafter.propose(seqs, limits, block_manager)
        self.no_room += cut
        for i, seq in enumerate(seqs):
            draft = drafts[i][:limits[i]]
            while draft and not block_manager.can_fit(seq.block_table, seq.num_tokens + len(draft)):
                draft = draft[:-1]
                self.no_room += 1
            if draft:
                block_manager.ensure_capacity(seq.block_table, seq.num_tokens + len(draft))
            drafts[i] = draft
            self.rollback(seq, block_manager, len(draft))  # room a drafter took beyond the draft kept
        rows, cached, tables, counts = self.rows(seqs, new_tokens, drafts)
        reread = sum(draft_context_reads(seq.num_cached, len(d)) for seq, d in zip(seqs, drafts))
        return StepPlan(new_tokens, [seq.in_prefill for seq in seqs], rows, cached, tables, drafts, counts, reread)

    def settle(self, seqs, plan: StepPlan, starts: list[int], block_manager, model) -> None:
        """After a step: rejected drafts' blocks back to the block manager, and each sequence's kept
        positions (starts[i] .. its num_cached - 1, at its rows of the step's forward) shown to a
        drafter that reads the hidden states."""
        if plan.verifying:
            for seq in seqs:
                if not seq.finished:
                    self.rollback(seq, block_manager)
        if self.drafter.wants_hidden:
            offsets = [0] * len(seqs)
            for i in range(1, len(seqs)):
                offsets[i] = offsets[i - 1] + plan.row_counts[i - 1]
            kept = [seq.num_cached - a for seq, a in zip(seqs, starts)]
            self.drafter.observe(seqs, starts, kept, model.last_hidden, offsets)

    @staticmethod
    def rows(seqs, new_tokens: list[list[int]], drafts: list[list[int]]):
        """The step's forward rows: a verifying sequence's last token and each of its drafts become
        one-token rows of their own (row j at position num_cached + j, attending to the context up to
        itself through the sequence's block table), so a verify step is a decode step of more rows.
        Every row's K/V is written before any row attends (each attention path writes the whole
        step's K/V first), so draft j sees the drafts before it. Returns (tokens, num_cached, block
        tables) per row, and each sequence's number of rows."""
        tokens, cached, tables, lens = [], [], [], []
        for seq, new, d in zip(seqs, new_tokens, drafts):
            if not d:
                tokens.append(new)
                cached.append(seq.num_cached)
                tables.append(seq.block_table)
                lens.append(len(new))
                continue
            for j, tok in enumerate(new + d):
                tokens.append([tok])
                cached.append(seq.num_cached + j)
                tables.append(seq.block_table)
            lens.append(len(d) + 1)
        return tokens, cached, tables, lens

    def select(self, seqs, plan: StepPlan, logits, counts: dict | None) -> list[list[int]]:
        """Each sequence's emitted tokens: its picks at its rows of `logits` (engine/sampling.py's
        choice, as plain decoding makes it), up to and including the first that differs from its
        draft (see the module's rule); one pick each in a step without drafts."""
        if not plan.verifying:
            if not all(plan.in_prefill):
                self.plain_decode_steps += 1  # a decode step without drafts (none found, or the batch policy)
            return [[t] for t in choose_tokens(logits, [seq.request.sampling for seq in seqs],
                                                [len(seq.output_ids) for seq in seqs], counts)]
        params, positions = [], []
        for seq, d in zip(seqs, plan.drafts):
            n = len(seq.output_ids)
            params.extend([seq.request.sampling] * (len(d) + 1))
            positions.extend(range(n, n + len(d) + 1))
        picks = choose_tokens(logits, params, positions, counts)
        emitted, at = [], 0
        for d in plan.drafts:
            row = picks[at:at + len(d) + 1]
            at += len(d) + 1
            kept = 0
            while kept < len(d) and row[kept] == d[kept]:
                kept += 1
            emitted.append(row[:kept + 1])
            if d:
                self._count(len(d), kept)
        self.verify_steps += 1
        return emitted

    def _count(self, drafted: int, kept: int) -> None:
        self.drafted += drafted
        self.accepted += kept
        self.verified_sequences += 1
        self.emitted_by_verify += kept + 1
        self.accepted_hist[kept] += 1
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < kept
        self._step["drafted"] += drafted
        self._step["accepted"] += kept
        self._step["accepted_lengths"].append(kept)  # per verifying sequence, in batch order

    @staticmethod
    def rollback(seq, block_manager, extra_tokens: int = 0) -> None:
        """Give back the blocks past what the sequence's tokens (and `extra_tokens` drafts) need:
        rejected drafts' room, or room a drafter reserved for drafts that were cut."""
        need = block_manager.blocks_needed(seq.num_tokens + extra_tokens)
        if len(seq.block_table) > need:
            extra = seq.block_table[need:]
            del seq.block_table[need:]
            block_manager.free(extra)

    def take_step(self) -> dict:
        """This step's drafted and accepted tokens and each verifying sequence's accepted length."""
        return {**self._step, "accepted_lengths": list(self._step["accepted_lengths"])}

    def evidence(self) -> dict:
        s = self.settings
        return {
            **s.to_dict(),
            **self.drafter.evidence(),
            "verify_steps": self.verify_steps,
            "plain_decode_steps": self.plain_decode_steps,
            "steps_off_by_batch": self.off_by_batch,
            "drafts_cut_for_kv_room": self.no_room,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "acceptance_by_position": [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)],
            "drafted_by_position": list(self.drafted_at),
            "accepted_length_histogram": list(self.accepted_hist),
            "tokens_per_verify": self.emitted_by_verify / self.verified_sequences if self.verified_sequences else None,
        }

    def activation_errors(self) -> list[str]:
        if self.settings.on and not self.drafted:
            why = f" ({self.off_by_batch} steps over --spec-max-batch {self.settings.max_batch})" if self.off_by_batch else ""
            return [f"speculative {self.settings.method}: no token was drafted{why}"]
        return []


# families whose per-sequence state is the paged KV cache alone, which num_cached rolls back; a
# recurrent state (bailing_hybrid's KDA) would be advanced by rejected drafts with no way back
ROLLBACK_FAMILIES = ("qwen3_moe", "mixtral")


def make_speculator(runtime, cfg=None, mtp_drafter=None) -> Speculator | None:
    """The session's speculator (None: off). `mtp_drafter()` builds the MTP drafter where the method
    asks for it (engine/mtp.py's make_mtp_drafter, bound to the session's checkpoint and model)."""
    s = spec_settings(runtime)
    if not s.on:
        return None
    family = getattr(cfg, "family", None)
    if cfg is not None and family not in ROLLBACK_FAMILIES:
        raise MoebenchError(f"--speculative {s.method}: a {family} model keeps per-sequence state besides the KV "
                            "cache that rejected drafts would advance and nothing rolls back; speculative decoding "
                            f"runs on {', '.join(ROLLBACK_FAMILIES)} models")
    if s.method == "mtp":
        if mtp_drafter is None:
            raise MoebenchError("--speculative mtp: no MTP head was given to this session")
        return Speculator(s, mtp_drafter())
    return Speculator(s)


def spec_settings(runtime) -> SpecSettings:
    """The session's settings; a limit not given is the method's own (DEFAULT_MAX_BATCH)."""
    given = runtime.spec_max_batch
    limit = given if given is not None else DEFAULT_MAX_BATCH.get(runtime.speculative)
    return SpecSettings(runtime.speculative, runtime.spec_tokens, limit, given is None)
