"""The engine process of `moebench serve`: the model, the KV cache and the scheduler, alone in a
process of their own, fed by the HTTP front end through a pipe.

Why a process and not a thread: every torch op releases and retakes the GIL, so an engine thread
beside the event loop paid a hand-off each time the loop had work, and its steps ran ~20% longer than
the same steps in-process. Here the process has one thread, which steps the engine and, between
steps, reads whatever the front end sent (`poll(0)`, a syscall). Detokenizing for the stream is
the front end's job; the engine sends token ids.

Messages, front end -> engine:
  ("add", [(key, prompt_ids, max_tokens, stops, arrival, sampling), ...])   sampling: SamplingParams or None
  ("abort", [key, ...])
  ("evidence", call_id)
  None                                      stop
Engine -> front end:
  ("loaded", {"vocab_size", "max_position_embeddings"})   the model is in memory
  ("ready", None)                                          warmed up; /health says ok
  ("step", [(key, new_ids, made, token_time, finish_reason, final_text, prompt_tokens), ...], counters)
      finish_reason None: the sequence goes on (final_text None)
  ("aborted", [key, ...], counters)                        taken out of the engine
  ("reply", call_id, result)
  ("failed", message)                                      the engine raised; the process ends
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import dataclass

COUNTERS = ("steps", "decode_tokens", "decode_s", "prefill_tokens", "prefill_s", "idle_s", "ok", "aborted")


@dataclass(frozen=True)
class CoreOptions:
    """Everything the engine process needs to build the engine."""

    model_path: str
    runtime: object  # moebench.engine.RuntimeConfig
    max_model_len: int | None
    max_queue: int
    batch_window_s: float
    threads: int | None


class EngineCore:
    """Runs in the engine process: owns the engine session and answers the pipe between steps."""

    def __init__(self, engine, conn, max_model_len: int, options: CoreOptions):
        self.engine = engine
        self.runtime = engine.runtime
        self.conn = conn
        self.max_model_len = max_model_len
        self.options = options
        self.session = None
        self.live: dict[int, tuple[int, object]] = {}  # key -> (tokens sent, sequence)
        self.key_of: dict[int, int] = {}  # id(sequence) -> key
        self.counters = dict.fromkeys(COUNTERS, 0)

    def run(self) -> None:
        self._warm_up()
        self.session = self.engine.session(self.max_model_len)
        self.conn.send(("ready", None))
        try:
            self._loop()
        finally:
            self.session.close()

    def _warm_up(self) -> None:
        """One short generation before /health says ready: first-use costs (the CPU kernel's build,
        lazy imports, allocator growth) must not land on the first client."""
        from moebench.engine import Request

        started = time.perf_counter()
        eos = set(self.engine.eos_ids)
        ids = [t for t in range(min(self.engine.cfg.vocab_size, 64)) if t not in eos][:8]
        self.engine.generate([Request("warm-up", "", 4)], prompt_ids=[ids])
        print(f"moebench serve: warm-up {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        session, conn = self.session, self.conn
        while True:
            if not session.has_work():
                idle_since = time.perf_counter()
                message = conn.recv()  # idle: sleep until something arrives
                self.counters["idle_s"] += time.perf_counter() - idle_since
                if not self._handle(message):
                    return
                if self.options.batch_window_s > 0:
                    if not self._gather():
                        return
            while conn.poll(0):  # whatever else arrived since the last step
                if not self._handle(conn.recv()):
                    return
            if session.has_work():
                record = session.step().to_dict()
                self._publish(session.last_batch, record)

    def _gather(self) -> bool:
        """After an idle spell, wait up to the batch window for the batch to fill: requests sent
        together reach the engine a little apart, and a static batch that started with the first
        would leave the rest waiting for the whole batch. False: a stop arrived."""
        deadline = time.perf_counter() + self.options.batch_window_s
        waiting = self.session.scheduler.waiting
        while len(waiting) < self.runtime.batch_size:
            left = deadline - time.perf_counter()
            if left <= 0 or not self.conn.poll(left):
                return True
            if not self._handle(self.conn.recv()):
                return False
        return True

    def _handle(self, message) -> bool:
        if message is None:
            return False
        kind = message[0]
        if kind == "add":
            from moebench.engine.sequence import Request, Sequence

            from moebench.engine.sampling import GREEDY

            for key, prompt_ids, max_tokens, stops, arrival, sampling in message[1]:
                request = Request(f"r{key}", "", max_tokens, stops, sampling or GREEDY)
                seq = Sequence(request, prompt_ids, max_tokens, arrival)
                self.live[key] = (0, seq)
                self.key_of[id(seq)] = key
                self.session.add(seq)
        elif kind == "abort":
            gone = []
            for key in message[1]:
                entry = self.live.get(key)
                if entry is not None and self.session.abort(entry[1]):
                    self._forget(key, entry[1])
                    self.counters["aborted"] += 1
                    gone.append(key)
            if gone:
                self.conn.send(("aborted", gone, dict(self.counters)))
        elif kind == "evidence":
            self.conn.send(("reply", message[1], self.evidence()))
        return True

    def _forget(self, key: int, seq) -> None:
        del self.live[key]
        del self.key_of[id(seq)]

    def _publish(self, batch, record: dict) -> None:
        c = self.counters
        c["steps"] += 1
        if record["phase"] == "prefill":
            c["prefill_tokens"] += record["num_tokens"]
            c["prefill_s"] += record["duration_s"]
        else:
            c["decode_tokens"] += record["decode_tokens"]
            c["decode_s"] += record["duration_s"]
        out = []
        for seq in batch:
            key = self.key_of.get(id(seq))
            if key is None:
                continue
            sent = self.live[key][0]
            ids = seq.output_ids
            made = len(ids)
            if seq.finished:
                self._forget(key, seq)
                c["ok"] += 1
                out.append((key, ids[sent:], made, seq.token_times[-1], seq.finish_reason, seq.text,
                            len(seq.prompt_ids)))
            elif made > sent:
                self.live[key] = (made, seq)
                out.append((key, ids[sent:], made, seq.token_times[-1], None, None, 0))
        if out:
            self.conn.send(("step", out, dict(c)))

    def evidence(self) -> dict:
        from moebench.kernels import fused_backend
        from moebench.kernels.cpu_attention import decode_attention_backend

        rt = self.runtime
        session = self.session
        ev = session.evidence()
        c = self.counters
        return {
            "schema": "moebench.serve.evidence/1",
            "switches": rt.switches(),
            "runtime": {"device": rt.device, "dtype": str(rt.torch_dtype).replace("torch.", ""),
                        "batch_size": rt.batch_size, "admission": rt.admission,
                        "expert_budget": rt.expert_budget, "offload_tier": rt.offload_tier,
                        "kv_block_size": rt.kv_block_size, "kv_capacity_tokens": session.kv_capacity_tokens,
                        "max_model_len": self.max_model_len, "max_queue": self.options.max_queue,
                        "batch_window_ms": self.options.batch_window_s * 1000,
                        "engine_process": os.getpid(), "torch_threads": _torch_threads(),
                        "overrides": rt.overrides.to_dict()},  # read once by `moebench serve` (engine/overrides.py)
            "backends": {"fused_moe": fused_backend(rt.device),
                         "decode_attention": decode_attention_backend(rt.device, rt.torch_dtype, rt.overrides.attention)},
            "evidence": ev,
            # judged over everything served so far; a switch with no evidence yet shows here
            "activation_errors": session.activation_errors(ev, session.num_requests),
            "requests": session.num_requests,
            "steps": session.num_steps,
            "decode_tokens": c["decode_tokens"],
            "decode_s": c["decode_s"],
            "prefill_tokens": c["prefill_tokens"],
            "prefill_s": c["prefill_s"],
            "idle_s": c["idle_s"],
            "engine_cpu_s": time.process_time(),  # the engine process's CPU time, all its threads
        }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def core_main(conn, options: CoreOptions, parent: int, close_fds: tuple[int, ...]) -> None:
    """The engine process's entry point (after fork): load, warm up, serve the pipe until told to
    stop, the pipe closes or the front end dies. A failure is reported on the pipe and on stderr."""
    from moebench.errors import MoebenchError
    from moebench.processes import die_with_parent

    die_with_parent(parent)
    for fd in close_fds:  # the listening socket belongs to the front end alone
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        import torch

        from moebench.engine import Engine
        from moebench.measuring.run import _load_model

        if options.threads:
            torch.set_num_threads(options.threads)
        from moebench.engine.overrides import apply_process_overrides

        apply_process_overrides(options.runtime.overrides, extension=options.runtime.device == "cpu")  # before the weights
        ckpt, tokenizer = _load_model(options.model_path, options.runtime)
        engine = Engine(ckpt, tokenizer, options.runtime)
        context = options.max_model_len or ckpt.config.max_position_embeddings
        conn.send(("loaded", {"vocab_size": ckpt.config.vocab_size,
                              "max_position_embeddings": ckpt.config.max_position_embeddings}))
        EngineCore(engine, conn, context, options).run()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the front end went away: nothing to tell
        pass
    except BaseException as e:
        if not isinstance(e, MoebenchError):  # a bug or a crash: the log gets the traceback
            traceback.print_exc()
            print(f"moebench serve: engine failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        try:  # the front end reports it (one line, exit 2) and fails the requests in flight
            conn.send(("failed", str(e) or type(e).__name__))
        except OSError:
            pass
    finally:
        conn.close()


def start_core(options: CoreOptions, close_fds: tuple[int, ...] = ()):
    """Fork the engine process. Returns (process, the front end's end of the pipe).

    Fork, not spawn: the child starts from the front end's state as it is (nothing but imports; no
    thread has started yet, and torch has run nothing), so it needs no re-import and inherits any
    patch a test made to the engine before starting the server."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=core_main, args=(theirs, options, os.getpid(), close_fds), name="moebench-engine",
                       daemon=True)
    proc.start()
    theirs.close()
    return proc, ours
