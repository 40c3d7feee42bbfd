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
from moebench.engine.runner import build_forward_batch
from moebench.engine.moe import MoeBlock, kernel_activation_errors, make_kernel
from moebench.engine.routing_stats import RoutingStats
from moebench.engine.sampling import sample_token_ids
from moebench.engine.scheduler import make_scheduler, max_resident, scheduler_activation_errors
from moebench.engine.sequence import Request, Sequence
from moebench.engine.mtp import make_mtp_drafter
from moebench.engine.speculative import draft_context_reads, make_speculator
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
    error = None  # an in-process request never fails alone (HTTP engines' completions may)

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


StepRecord = dict


@dataclass
class GenerationResult:
    completions: list[Completion]
    steps: list[StepRecord]
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
    ) -> GenerationResult:
        """Run every request to completion. `prompt_ids` bypasses the tokenizer (tests, benchmarks)."""
        rt = self.runtime
        arrival = time.perf_counter()
        seqs = []
        for i, req in enumerate(requests):
            ids = prompt_ids[i] if prompt_ids is not None else self.encode(req.prompt)
            if not ids:
                raise MoebenchError(f"request {req.id}: empty prompt")
            seqs.append(Sequence(req, list(ids), req.max_new_tokens or rt.max_new_tokens, arrival))
        if not seqs:
            return GenerationResult([], [], {}, [], 0.0)

        session = EngineSession(self, self._kv_blocks(seqs), on_complete, arrival)
        for s in seqs:
            session.add(s)
        steps: list[StepRecord] = []
        try:
            while session.has_work():
                steps.append(session.step())
        finally:
            session.close()
        wall = time.perf_counter() - arrival

        evidence = session.evidence()
        errors = session.activation_errors(evidence, len(seqs))
        order = {r.id: i for i, r in enumerate(requests)}
        completions = session.completions
        completions.sort(key=lambda c: order[c.id])
        return GenerationResult(completions, steps, evidence, errors, wall, session.stats.load.tolist())

    def session(self, max_sequence_tokens: int, on_complete: Callable[[Completion], None] | None = None) -> EngineSession:
        """A long-lived session (a server's): its KV cache holds every request the scheduler may keep
        resident at `max_sequence_tokens` tokens (prompt plus generation) each."""
        blocks = max_resident(self.runtime) * -(-max_sequence_tokens // self.runtime.kv_block_size) + 1
        return EngineSession(self, blocks, on_complete, time.perf_counter())

    def _step(self, index, seqs, runner, kv, block_manager, stats, store, scheduler, completions, on_complete, arrival,
              step_start, sampling_counts=None, speculator=None, model=None):
        rt = self.runtime
        new_tokens = [_new_token_ids(s) for s in seqs]
        in_prefill = [s.in_prefill for s in seqs]
        for s in seqs:
            block_manager.ensure_capacity(s.block_table, s.num_tokens)
        # speculative decoding (engine/speculative.py): a verifying sequence's drafts are rows of their own
        drafts = speculator.plan(seqs, new_tokens, block_manager) if speculator else None
        verify = bool(drafts) and any(drafts)
        reread = 0  # context tokens a verify step's draft rows read again (row j: num_cached + j + 1)
        if verify:
            rows, cached, tables, lens = speculator.rows(seqs, new_tokens, drafts)
            reread = sum(draft_context_reads(s.num_cached, len(d)) for s, d in zip(seqs, drafts))
            if hasattr(scheduler, "tokens_ran"):
                scheduler.tokens_ran(lens)
        else:
            rows, cached, tables = new_tokens, [s.num_cached for s in seqs], [s.block_table for s in seqs]
        batch = build_forward_batch(rows, cached, tables, rt.kv_block_size, rt.device, self.cfg.sliding_window,
                                    self.torch_dtype)
        start = time.perf_counter()
        logits = runner.run(batch, kv)
        if verify:
            emitted = speculator.select(seqs, logits, drafts, sampling_counts, greedy_token_ids)
        else:
            emitted = [[t] for t in self._select_tokens(seqs, logits, sampling_counts)]
            if speculator and not all(in_prefill):
                speculator.plain_step()
        if rt.device == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        forward_s = end - start

        routing = stats.take_step()
        starts = [s.num_cached for s in seqs] if speculator else None
        callbacks_s = 0.0  # the caller's own work (writing samples) is not the engine's
        decode_emitted = 0
        for s, tokens, picks, draft, prefill in zip(seqs, new_tokens, emitted, drafts or [()] * len(seqs), in_prefill):
            # the K/V kept: the step's tokens but the rejected drafts (theirs stay past num_cached,
            # outside the context, and are overwritten); the newest pick's is the next step's to write
            s.num_cached += len(tokens) + len(picks) - 1
            reason = None
            for tok in picks:
                decode_emitted += not prefill  # a pick after the one that finished the sequence is not emitted
                s.output_ids.append(tok)
                s.token_times.append(end - s.arrival)
                reason = self._finish_reason(s, tok)
                if reason:
                    break
            if verify and not reason:
                speculator.rollback(s, block_manager)
            if reason:
                s.finish_reason = reason
                scheduler.finish(s)
                c = Completion(s.id, s.text, list(s.output_ids), len(s.prompt_ids), reason,
                               s.token_times[0], s.token_times[-1], list(s.token_times))
                completions.append(c)
                if on_complete:
                    t = time.perf_counter()
                    on_complete(c)
                    callbacks_s += time.perf_counter() - t

        if speculator:  # the positions each sequence kept, and their rows of the step's forward
            row_counts = lens if verify else [len(t) for t in new_tokens]
            offsets = [0] * len(seqs)
            for i in range(1, len(seqs)):
                offsets[i] = offsets[i - 1] + row_counts[i - 1]
            speculator.observe(seqs, starts, [s.num_cached - a for s, a in zip(seqs, starts)], model, offsets)

        n_prefill = sum(in_prefill)
        phase = "prefill" if n_prefill == len(seqs) else ("decode" if n_prefill == 0 else "mixed")
        record = {
            "step": index,
            "phase": phase,
            "batch_size": len(seqs),
            "num_tokens": sum(len(t) for t in new_tokens) + sum(map(len, drafts or ())),
            "decode_tokens": decode_emitted,  # tokens emitted (accepted drafts included), not positions verified
            "duration_s": time.perf_counter() - step_start - callbacks_s,
            "forward_s": forward_s,
            **routing,
            **scheduler.take_step(),
            **store.take_step(),
            **(speculator.take_step() if speculator else {}),
        }
        record["bytes_read"] = self.bytes_read(stats_experts=routing, seqs=seqs, reread_tokens=reread)
        return record

    @staticmethod
    def _select_tokens(seqs, logits, counts: dict | None) -> list[int]:
        """Each sequence's next token: the plain argmax when the whole batch is greedy (the fast
        path), else engine/sampling.py, one draw per sampling row at its output position. `counts`
        (the session's evidence) gets the positions drawn and those chosen greedily."""
        params = [s.request.sampling for s in seqs]
        if all(p.greedy for p in params):
            ids, drawn = greedy_token_ids(logits), 0
        else:
            ids, drawn = sample_token_ids(logits, params, [len(s.output_ids) for s in seqs])
            if counts is not None:
                for p in {p.setting() for p in params if not p.greedy}:
                    counts["settings"].add(p)
        if counts is not None:
            counts["sampled_positions"] += drawn
            counts["greedy_positions"] += len(seqs) - drawn
        return ids

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

    def _finish_reason(self, s: Sequence, tok: int) -> str | None:
        if tok in self.eos_ids:
            s.output_ids.pop()
            s.text = self.decode(s.output_ids) if self.tokenizer else ""
            return "stop"
        if self.tokenizer is not None and s.request.stop and self._may_end_in_stop(s):
            text = self.decode(s.output_ids)
            cut = min((i for i in (text.find(stop) for stop in s.request.stop) if i >= 0), default=-1)
            if cut >= 0:
                s.text = text[:cut]
                return "stop"
        if len(s.output_ids) >= s.max_new_tokens:
            if self.tokenizer is not None:
                s.text = self.decode(s.output_ids)
            return "length"
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
        self.store, self.prefetcher = make_store_and_prefetcher(engine.ckpt, rt)
        self.model.moe_block = MoeBlock(self.model.route, self.kernel, self.store, self.prefetcher, self.stats)
        self.scheduler = make_scheduler(rt, self.block_manager)
        if hasattr(self.scheduler, "attach"):
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
        """One engine step; its sequences (each one token longer, or finished) are in `last_batch`."""
        # A step's time covers all the engine does for it (choosing the batch, building it,
        # the forward, sampling, bookkeeping): a costly scheduler must not look free.
        step_start = time.perf_counter()
        batch_seqs = self.scheduler.schedule()
        if not batch_seqs:
            raise MoebenchError("scheduler made no progress (a request cannot fit in the KV cache)")
        self.last_batch = batch_seqs
        record = self.engine._step(self.num_steps, batch_seqs, self.runner, self.kv, self.block_manager, self.stats,
                                   self.store, self.scheduler, self.completions, self.on_complete, self.arrival,
                                   step_start, self.sampling_counts, self.speculator, self.model)
        self.num_steps += 1
        return record

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
        return errors


def greedy_token_ids(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest logit (a NaN counts as largest), as torch's argmax. On the
    CPU numpy's argmax gives the same index several times faster (32000 logits: ~30 us against ~110
    us; 16 rows: ~0.1 ms against ~1.4 ms), and it runs once per decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()
