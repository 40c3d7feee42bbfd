"""The generation loop: the scheduler picks a batch, the model runs one step, tokens are appended,
finished requests leave. Every step is recorded; every strategy reports its activation evidence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from moebench.engine.config import RuntimeConfig
from moebench.engine.store.factory import make_store_and_prefetcher
from moebench.engine.families import cache_bytes_rates, make_cache_and_model, make_runner, non_expert_bytes_per_step
from moebench.engine.loader import Checkpoint
from moebench.engine.runner import StepPlan, build_forward_batch
from moebench.engine.moe import MoeBlock, RoutingStats, kernel_activation_errors, make_kernel
from moebench.engine.sampling import choose_tokens
from moebench.engine.scheduler import make_scheduler, max_resident, scheduler_activation_errors
from moebench.engine.sequence import Request, Sequence
from moebench.engine.mtp import make_mtp_drafter
from moebench.engine.speculative import make_speculator
from moebench.errors import MoebenchError


@dataclass
class Completion:
    id: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float
    latency_s: float
    token_times: list[float]
    scheduled_s: float | None = None  # open loop: when it was due, seconds from the run's start
    sent_s: float | None = None  # when it was handed to the engine, seconds from the run's start
    error = None  # an in-process request never fails alone (HTTP engines' completions may)

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class StepRecord:
    """One engine step as steps.parquet keeps it (`to_dict`: one flat row)."""

    step: int
    phase: str  # prefill | decode | mixed
    batch_size: int
    num_tokens: int  # positions the forward ran (drafts included)
    decode_tokens: int  # tokens emitted by decoding sequences (accepted drafts included)
    duration_s: float  # all the engine did for the step: scheduling, the forward, sampling, bookkeeping
    forward_s: float
    bytes_read: int  # the least the step had to read (Engine.bytes_read)
    routing: dict  # distinct experts and load imbalance (RoutingStats.take_step)
    scheduler: dict  # the queue (Scheduler.take_step)
    store: dict  # the expert store's loads, hits and stalls (its take_step)
    speculative: dict | None = None  # drafts and acceptances (Speculator.take_step), None when off

    def to_dict(self) -> dict:
        return {"step": self.step, "phase": self.phase, "batch_size": self.batch_size, "num_tokens": self.num_tokens,
                "decode_tokens": self.decode_tokens, "duration_s": self.duration_s, "forward_s": self.forward_s,
                **self.routing, **self.scheduler, **self.store, **(self.speculative or {}),
                "bytes_read": self.bytes_read}


@dataclass(frozen=True)
class Ending:
    """How a token ends its sequence (Engine.ending): the finish reason and the final text."""

    reason: str  # stop | length
    text: str
    drop_last: bool = False  # the token is the EOS, which is no part of the output


@dataclass
class GenerationResult:
    completions: list[Completion]
    steps: list[dict]  # StepRecord.to_dict() of each step
    evidence: dict
    activation_errors: list[str]
    wall_s: float
    expert_load: list[list[int]] = field(default_factory=list)

    def phase_totals(self, phase_tokens: str, phases: tuple[str, ...]) -> tuple[int, float]:
        tokens = sum(s[phase_tokens] for s in self.steps if s["phase"] in phases)
        seconds = sum(s["duration_s"] for s in self.steps if s["phase"] in phases)
        return tokens, seconds


def _new_token_ids(s: Sequence) -> list[int]:
    """`s.new_token_ids` without first joining prompt and output (a decode step's one new token
    would otherwise cost a copy of the whole sequence)."""
    prompt = len(s.prompt_ids)
    if s.num_cached >= prompt:
        return s.output_ids[s.num_cached - prompt:]
    return s.prompt_ids[s.num_cached:] + s.output_ids


class Engine:
    def __init__(self, ckpt: Checkpoint, tokenizer, runtime: RuntimeConfig):
        if runtime.weights != "f32":  # the streamed matrices in that precision (--weights, docs/int8.md)
            from moebench.engine.quantize import weights_in

            if ckpt.config.family == "bailing_hybrid":
                raise MoebenchError(f"--weights {runtime.weights}: the {ckpt.config.family} model runs its "
                                    "checkpoint's own weights only")
            ckpt = weights_in(ckpt, runtime.weights)
        self.ckpt = ckpt
        self.cfg = ckpt.config
        self.tokenizer = tokenizer
        self.runtime = runtime
        if runtime.device == "cpu":  # the AVX-512 choice and the pool's spin live in the extension
            from moebench.engine.overrides import apply_process_overrides

            apply_process_overrides(runtime.overrides)
        self.torch_dtype = runtime.torch_dtype  # (a property of the frozen runtime: read once, not per step)
        self.eos_ids = set(self.cfg.eos_token_ids)
        self._read_sizes = None  # see bytes_read
        self._stop_tokens: dict = {}  # (stop strings, token id) -> can it end one (see _may_end_in_stop)
        if tokenizer is not None and not self.eos_ids:
            for name in ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>"):
                tid = tokenizer.token_to_id(name)
                if tid is not None:
                    self.eos_ids.add(tid)

    def store_and_prefetcher(self):
        """The expert store and prefetch strategy each new session runs (engine/store/factory.py),
        composed here so that an engine built on this one (a benchmark's) can compose its own."""
        return make_store_and_prefetcher(self.ckpt, self.runtime)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _kv_blocks(self, seqs: list[Sequence]) -> int:
        bs = self.runtime.kv_block_size
        longest = max(len(s.prompt_ids) + s.max_new_tokens for s in seqs)
        return max_resident(self.runtime) * -(-longest // bs) + 1

    def generate(
        self,
        requests: list[Request],
        on_complete: Callable[[Completion], None] | None = None,
        prompt_ids: list[list[int]] | None = None,
        arrivals: list[float] | None = None,
    ) -> GenerationResult:
        """Run every request to completion. `prompt_ids` bypasses the tokenizer (tests, benchmarks).
        `arrivals` (seconds from the start, one per request): an open loop, each request handed over
        at its time (engine/open_loop.py); None: all queued at the start."""
        rt = self.runtime
        start = time.perf_counter()  # closed loop: tokenizing the prompts is part of the run, as always
        seqs = []
        for i, req in enumerate(requests):
            ids = prompt_ids[i] if prompt_ids is not None else self.encode(req.prompt)
            if not ids:
                raise MoebenchError(f"request {req.id}: empty prompt")
            seqs.append(Sequence(req, list(ids), req.max_new_tokens or rt.max_new_tokens, 0.0))
        if not seqs:
            return GenerationResult([], [], {}, [], 0.0)

        session = EngineSession(self, self._kv_blocks(seqs), on_complete, start)
        steps: list[dict] = []
        try:
            if arrivals is None:
                for s in seqs:
                    s.arrival = start
                    session.add(s)
                while session.has_work():
                    steps.append(session.step().to_dict())
            else:  # the clock starts when the engine's session is ready for the first request
                start = self._run_open_loop(session, seqs, arrivals, steps)
        finally:
            session.close()
        wall = time.perf_counter() - start

        evidence = session.evidence()
        errors = session.activation_errors(evidence, len(seqs))
        order = {r.id: i for i, r in enumerate(requests)}
        completions = session.completions
        completions.sort(key=lambda c: order[c.id])
        return GenerationResult(completions, steps, evidence, errors, wall, session.stats.load.tolist())

    @staticmethod
    def _run_open_loop(session: EngineSession, seqs: list[Sequence], arrivals: list[float],
                       steps: list[dict]) -> float:
        """Steps until every request has arrived and finished; returns the clock's start."""
        from moebench.engine.open_loop import ArrivalFeeder

        pending = len(seqs)
        with ArrivalFeeder(seqs, arrivals).running() as feeder:
            session.arrival = feeder.start
            while pending or session.has_work():
                for s in feeder.take(block=pending > 0 and not session.has_work()):
                    session.add(s)
                    pending -= 1
                if session.has_work():
                    steps.append(session.step().to_dict())
        return feeder.start

    def session(self, max_sequence_tokens: int, on_complete: Callable[[Completion], None] | None = None) -> EngineSession:
        """A long-lived session (a server's): its KV cache holds every request the scheduler may keep
        resident at `max_sequence_tokens` tokens (prompt plus generation) each."""
        blocks = max_resident(self.runtime) * -(-max_sequence_tokens // self.runtime.kv_block_size) + 1
        return EngineSession(self, blocks, on_complete, time.perf_counter())

    def bytes_read(self, stats_experts: dict, seqs, reread_tokens: int = 0) -> int:
        """Bytes a step must read at least: active experts' weights, the rest of the weights, the KV cache."""
        cfg = self.cfg
        if self._read_sizes is None:  # per-model constants, worked out once
            from moebench.engine.store.factory import store_layout

            elt = torch.empty(0, dtype=self.torch_dtype).element_size()
            # experts in the dtype the store holds them in (bfloat16 rows of a bfloat16 checkpoint on the CPU)
            expert_dtype = store_layout(self.ckpt, self.runtime)[0]
            per_expert = cfg.expert_param_count * torch.empty(0, dtype=expert_dtype).element_size()
            if expert_dtype in (torch.int8, torch.uint8):  # rows as held, with their scales (--weights int8, int4)
                from moebench.kernels.reference import stored_width

                H, I = cfg.hidden_size, cfg.moe_intermediate_size
                per_expert = 2 * I * stored_width(H, expert_dtype) + H * stored_width(I, expert_dtype)
            moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
            other = non_expert_bytes_per_step(self.ckpt, elt)  # int8 attention matrices as held (families.py)
            if self.runtime.lm_head != "f32":  # the head read in its own precision (--lm-head)
                from moebench.engine.quantize import lm_head_bytes

                V, H = cfg.vocab_size, cfg.hidden_size
                # non_expert_bytes_per_step counted the head as held (a bf16 checkpoint's: bfloat16)
                other += lm_head_bytes(V, H, self.runtime.lm_head, elt) - V * H * self.ckpt.lm_head.element_size()
            kv_per_token, kv_per_sequence = cache_bytes_rates(cfg, elt)  # (families.py)
            self._read_sizes = (per_expert, moe_layers, other, kv_per_token, kv_per_sequence)
        per_expert, moe_layers, other, kv_per_token, kv_per_sequence = self._read_sizes
        expert_bytes = stats_experts["distinct_experts"] * moe_layers * per_expert
        kv_tokens = sum(len(s.prompt_ids) + len(s.output_ids) for s in seqs) + reread_tokens
        kv = kv_tokens * kv_per_token + len(seqs) * kv_per_sequence
        return int(expert_bytes + other + kv)

    def ending(self, s: Sequence, tok: int) -> Ending | None:
        """How `tok`, just appended to s.output_ids, ends the sequence (its reason and final text), or
        None where it goes on. Changes nothing: the step applies it (EngineSession._finish)."""
        if tok in self.eos_ids:
            return Ending("stop", self.decode(s.output_ids[:-1]) if self.tokenizer else "", drop_last=True)
        if self.tokenizer is not None and s.request.stop and self._may_end_in_stop(s):
            text = self.decode(s.output_ids)
            cut = min((i for i in (text.find(stop) for stop in s.request.stop) if i >= 0), default=-1)
            if cut >= 0:
                return Ending("stop", text[:cut])
        if len(s.output_ids) >= s.max_new_tokens:
            return Ending("length", self.decode(s.output_ids) if self.tokenizer is not None else s.text)
        return None

    def _may_end_in_stop(self, s: Sequence) -> bool:
        """Whether the newest token can have completed a stop string. Earlier steps found none, so
        one would have to end in it: where every stop string ends in an ASCII character, the token's
        own text must hold one of those characters (a printable ASCII byte is never part of a multi-byte
        character, so decoding the token alone shows it); that answer is cached per token id, and
        the whole output is decoded only when it is yes. Otherwise, always."""
        key = (tuple(s.request.stop), s.output_ids[-1])
        hit = self._stop_tokens.get(key)
        if hit is None:  # worked out once per (stop strings, token)
            last = {stop[-1] for stop in key[0]}
            if all(ch.isascii() and not ch.isspace() for ch in last):  # (a lone token may lose its spaces)
                text = self.decode([key[1]])
                hit = any(ch in text for ch in last)
            else:
                hit = True
            self._stop_tokens[key] = hit
        return hit


class EngineSession:
    """One KV cache, expert store, model and scheduler that requests can join between steps.

    `Engine.generate` runs a session until its requests are done; `moebench serve` keeps one open
    and adds requests as they arrive, so a continuous scheduler admits them into the running batch
    at the next step and a static one at the next batch."""

    def __init__(self, engine: Engine, num_kv_blocks: int, on_complete: Callable[[Completion], None] | None,
                 arrival: float):
        rt, cfg = engine.runtime, engine.cfg
        self.engine = engine
        self.arrival = arrival
        self.on_complete = on_complete
        # the family's block manager, cache and forward (engine/families.py)
        self.block_manager, self.kv, self.model = make_cache_and_model(engine.ckpt, rt, num_kv_blocks)
        self.stats = RoutingStats(cfg.num_layers, cfg.num_experts)
        self.kernel = make_kernel(rt.kernel, rt.overrides)
        self.store, self.prefetcher = engine.store_and_prefetcher()
        self.model.moe_block = MoeBlock(self.model.route, self.kernel, self.store, self.prefetcher, self.stats)
        self.scheduler = make_scheduler(rt, self.block_manager)
        self.scheduler.attach(self.stats)
        self.completions: list[Completion] = []  # finished requests, in the order they finished
        self.num_steps = 0
        self.num_requests = 0
        self.last_batch: list[Sequence] = []
        # what token selection did, counted where it ran (engine/sampling.py): the evidence that a
        # temperature reached the sampler
        self.sampling_counts = {"sampled_positions": 0, "greedy_positions": 0, "settings": set()}
        self.sampling_requests = 0  # requests added that asked for sampling
        # None: speculative decoding off (an MTP head gets a cache of num_kv_blocks beside the model's)
        self.speculator = make_speculator(
            rt, cfg, lambda: make_mtp_drafter(engine.ckpt, self.model, num_kv_blocks, rt.kv_block_size))
        # how each step's forward runs, decided once (engine/decode_path.py) after the MTP head asked
        # the model for its hidden states: the runner binds the ops it runs (engine/runner.py)
        self.runner = make_runner(engine.ckpt, rt, self.model, self.model.moe_block)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.num_requests += 1
        self.sampling_requests += not seq.request.sampling.greedy

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepRecord:
        """One engine step, as nano-vllm's: the scheduler picks the batch, the runner runs it, the
        picked tokens are appended and finished requests leave. Its sequences (each one token longer,
        or finished) are in `last_batch`. The step's time covers all the engine does for it: a costly
        scheduler must not look free."""
        start = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            raise MoebenchError("scheduler made no progress (a request cannot fit in the KV cache)")
        self.last_batch = seqs
        batch, plan = self._prepare(seqs)
        forward_start = time.perf_counter()
        logits = self.runner.run(batch, self.kv)
        forward_end = time.perf_counter()
        record = self._postprocess(seqs, plan, logits, start, forward_start, forward_end)
        self.num_steps += 1
        return record

    def _prepare(self, seqs: list[Sequence]):
        """The step's forward batch: each sequence's new tokens and KV room for them, and, where the
        speculator drafts, the drafts as rows of their own (engine/speculative.py). -> (batch, plan)."""
        rt = self.engine.runtime
        new_tokens = [_new_token_ids(s) for s in seqs]
        for s in seqs:
            self.block_manager.ensure_capacity(s.block_table, s.num_tokens)
        if self.speculator is not None:
            plan = self.speculator.plan(seqs, new_tokens, self.block_manager)
            if plan.verifying:
                self.scheduler.tokens_ran(plan.row_counts)
        else:
            plan = StepPlan(new_tokens, [s.in_prefill for s in seqs], new_tokens, [s.num_cached for s in seqs],
                            [s.block_table for s in seqs])
        batch = build_forward_batch(plan.rows, plan.cached, plan.tables, rt.kv_block_size, rt.device,
                                    self.engine.cfg.sliding_window, self.engine.torch_dtype)
        return batch, plan

    def _postprocess(self, seqs, plan: StepPlan, logits, start: float, forward_start: float,
                     forward_end: float) -> StepRecord:
        """The picked tokens appended, finished sequences out of the scheduler and completed, and the
        step's record."""
        if self.speculator is not None:
            emitted = self.speculator.select(seqs, plan, logits, self.sampling_counts)
        else:
            emitted = [[t] for t in choose_tokens(logits, [s.request.sampling for s in seqs],
                                                   [len(s.output_ids) for s in seqs], self.sampling_counts)]
        routing = self.stats.take_step()
        starts = [s.num_cached for s in seqs]
        callbacks_s = 0.0  # the caller's own work (writing samples) is not the engine's
        decode_emitted = 0
        for s, tokens, picks, prefill in zip(seqs, plan.new_tokens, emitted, plan.in_prefill):
            # the K/V kept: the step's tokens but the rejected drafts (theirs stay past num_cached,
            # outside the context, and are overwritten); the newest pick's is the next step's to write
            s.num_cached += len(tokens) + len(picks) - 1
            ending = None
            for tok in picks:
                decode_emitted += not prefill  # a pick after the one that finished the sequence is not emitted
                s.output_ids.append(tok)
                s.token_times.append(forward_end - s.arrival)
                ending = self.engine.ending(s, tok)
                if ending:
                    break
            if ending:
                callbacks_s += self._finish(s, ending)
        if self.speculator is not None:  # rejected drafts' room back, and what a drafter learns from the step
            self.speculator.settle(seqs, plan, starts, self.block_manager, self.model)
        n_prefill = sum(plan.in_prefill)
        return StepRecord(
            step=self.num_steps,
            phase="prefill" if n_prefill == len(seqs) else ("decode" if n_prefill == 0 else "mixed"),
            batch_size=len(seqs),
            num_tokens=sum(map(len, plan.rows)),
            decode_tokens=decode_emitted,
            duration_s=time.perf_counter() - start - callbacks_s,
            forward_s=forward_end - forward_start,
            bytes_read=self.engine.bytes_read(routing, seqs, plan.reread),
            routing=routing,
            scheduler=self.scheduler.take_step(),
            store=self.store.take_step(),
            speculative=self.speculator.take_step() if self.speculator is not None else None,
        )

    def _finish(self, s: Sequence, ending: Ending) -> float:
        """`s` ends as `ending` says: out of the scheduler, its completion made and handed to the
        caller. Returns the seconds the caller's callback took (not the engine's time)."""
        if ending.drop_last:
            s.output_ids.pop()
        s.text = ending.text
        s.finish_reason = ending.reason
        self.scheduler.finish(s)
        c = Completion(s.id, s.text, list(s.output_ids), len(s.prompt_ids), ending.reason,
                       s.token_times[0], s.token_times[-1], list(s.token_times), s.scheduled_s,
                       s.arrival - self.arrival)
        self.completions.append(c)
        if not self.on_complete:
            return 0.0
        t = time.perf_counter()
        self.on_complete(c)
        return time.perf_counter() - t

    def abort(self, seq: Sequence) -> bool:
        """Take a request out (its client went away): out of the queue, or finished with reason
        "abort" and its KV blocks freed. False when it had finished already."""
        if seq.finished:
            return False
        waiting = self.scheduler.waiting
        queued = next((i for i, s in enumerate(waiting) if s is seq), None)  # identity: equal fields are not the same request
        if queued is not None:
            del waiting[queued]
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        return True

    def close(self) -> None:
        self.store.close()

    def token_logprobs(self, ids: list[int]) -> tuple[list[float], list[bool]]:
        """Scoring, not generation (lm-eval's loglikelihood): for each of ids[1:], its log-probability
        given the tokens before it, and whether it was the greedy choice. One prefill of the whole
        sequence with logits at every position; its KV blocks are freed again. Only between steps."""
        if len(ids) < 2:
            raise MoebenchError("scoring needs at least two tokens (a context and a continuation)")
        rt = self.engine.runtime
        table: list[int] = []
        self.block_manager.ensure_capacity(table, len(ids))
        try:
            batch = build_forward_batch([list(ids)], [0], [table], rt.kv_block_size, rt.device,
                                        self.engine.cfg.sliding_window, rt.torch_dtype)
            logits = self.runner.run(batch, self.kv, all_positions=True)[:-1]
            self.stats.take_step()
        finally:
            self.block_manager.free(table)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(ids[1:], device=logprobs.device)
        picked = logprobs.gather(1, target[:, None])[:, 0]
        greedy = logprobs.argmax(dim=-1) == target
        return picked.tolist(), greedy.tolist()

    def evidence(self) -> dict:
        return {
            "kernel": self.kernel.evidence(),
            "scheduler": {**self.scheduler.evidence(), "kv_block_reuses": self.block_manager.reuses},
            "prefetch": {**self.store.evidence(), **self.prefetcher.evidence()},
            # decode attention calls by the implementation that ran them (engine/model.py)
            "attention": dict(getattr(self.model, "attention_backends", {})),
            # decode steps by how their layers ran, batch by batch: in one native call, layer by layer,
            # or the ops one by one where a batch had more rows than the step ops take (engine/runner.py)
            "decode_steps": dict(self.runner.decode_steps),
            # the path decode steps ran, decided once for the session, and their threads (engine/decode_path.py)
            "decode_path": self.runner.evidence(),
            "sampling": {"sampled_positions": self.sampling_counts["sampled_positions"],
                         "greedy_positions": self.sampling_counts["greedy_positions"],
                         "settings": [list(s) for s in sorted(self.sampling_counts["settings"], key=repr)]},
            "speculative": self.speculator.evidence() if self.speculator else {"method": "off"},
            # the LM head's precision and what its kernel streamed, by weight dtype (engine/model.py)
            **({"lm_head": self.model.lm_head_evidence()} if hasattr(self.model, "lm_head_evidence") else {}),
            # the weights' precision and what the kernels streamed of them, by weight dtype (engine/model.py)
            **({"weights": self.model.weights_evidence()} if hasattr(self.model, "weights_evidence") else {}),
        }

    def activation_errors(self, evidence: dict, num_requests: int) -> list[str]:
        rt = self.engine.runtime
        errors = kernel_activation_errors(rt.kernel, evidence["kernel"])
        errors += scheduler_activation_errors(rt.scheduler, evidence["scheduler"], num_requests, rt.batch_size)
        if hasattr(self.prefetcher, "activation_errors"):
            errors += self.prefetcher.activation_errors(self.store)
        from moebench.engine.model import decode_attention_errors

        errors += decode_attention_errors(evidence.get("attention"), rt.device, rt.torch_dtype, rt.overrides)
        if self.sampling_requests and not self.sampling_counts["sampled_positions"]:
            errors.append(f"sampling: {self.sampling_requests} requests asked for it and the engine drew no token")
        errors += self.runner.activation_errors()
        if self.speculator:
            errors += self.speculator.activation_errors()
        if rt.lm_head != "f32":
            from moebench.engine.model import lm_head_errors

            errors += lm_head_errors(evidence.get("lm_head"), rt.device, rt.overrides)
        if rt.weights != "f32":
            from moebench.engine.weight_evidence import weights_errors

            errors += weights_errors(evidence.get("weights"), evidence["prefetch"].get("expert_dtype"),
                                     rt.overrides.allow_fallback)
        if rt.overrides.activations != "f32":
            from moebench.engine.weight_evidence import activations_errors

            errors += activations_errors(rt.overrides.activations, evidence.get("decode_path"), rt)
        return errors
