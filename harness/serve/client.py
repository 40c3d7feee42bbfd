"""The HTTP front end's handle on the engine process of `moebench serve`: it forks the engine core
(`moebench.serve.core`), feeds it requests through a pipe, and turns the token ids each step sends
back into events on each request's handle."""

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from moebench.errors import MoebenchError
from moebench.serve.protocol import ApiError
from moebench.serve.stream import TextStream


@dataclass
class Handle:
    """One sequence a client waits for. The event loop fills `sink` from the engine's messages."""

    index: int  # the choice index inside its HTTP request
    sink: object  # asyncio.Queue of events, shared by the choices of one HTTP request
    prompt_ids: list[int]
    max_tokens: int
    stops: tuple[str, ...]
    stream: TextStream
    sampling: object = None  # moebench.engine.sampling.SamplingParams (None: greedy)
    output_ids: list[int] = field(default_factory=list)
    key: int = -1  # the engine's name for it
    arrival: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Event:
    """A piece of a choice's output. `finish_reason` set: the choice is done (`tokens`: all it made)."""

    index: int
    text: str
    tokens: int
    token_time_s: float
    finish_reason: str | None = None
    prompt_tokens: int = 0


class EngineClient:
    """The front end's side of the engine process (`moebench.serve.core`): sends requests down the
    pipe, and turns what comes back into each response's events on the event loop. A reader thread
    waits on the pipe; everything else (the handles, detokenizing, the counters) is the loop's."""

    def __init__(self, options, tokenizer_path: Path, close_fds: tuple[int, ...] = ()):
        from moebench.serve.core import COUNTERS, start_core

        self.max_queue = options.max_queue
        self.proc, self.conn = start_core(options, close_fds)
        kind, info = self._first_message()
        if kind == "failed":
            self.proc.join(timeout=10)
            raise MoebenchError(info)
        self.vocab_size = info["vocab_size"]
        self.max_model_len = options.max_model_len or info["max_position_embeddings"]
        # after the fork: the tokenizer's own threads must not exist in the engine process
        from moebench.engine.loader import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self.loop = None
        self.ready = threading.Event()
        self.failed: str | None = None
        self.on_failure = None  # called on the event loop if the engine dies (the server then shuts down)
        self.in_server = 0  # sequences accepted and not finished
        self._live: dict[int, Handle] = {}
        self._next_key = 0
        self._calls: dict[int, object] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="moebench-engine-reader", daemon=True)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.m_rejected = 0
        self.m_text_mismatch = 0
        self.m_prompt_tokens = 0
        self.m_generated_tokens = 0

    def _first_message(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(timeout=10)
            raise MoebenchError(f"the engine process ended while loading the model (exit code {self.proc.exitcode})")

    # --- lifecycle (event loop side)

    def start(self, loop) -> None:
        self.loop = loop
        self._reader.start()

    def stop(self) -> None:
        try:
            self._send(None)
        except OSError:
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def _send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    # --- requests (event loop side)

    def submit(self, handles: list[Handle]) -> None:
        for h in handles:
            h.key, self._next_key = self._next_key, self._next_key + 1
            self._live[h.key] = h
        self.in_server += len(handles)
        self.m_prompt_tokens += sum(len(h.prompt_ids) for h in handles)
        self._send(("add", [(h.key, h.prompt_ids, h.max_tokens, h.stops, h.arrival, h.sampling) for h in handles]))

    def abort(self, handles: list[Handle]) -> None:
        if self.failed is None:
            self._send(("abort", [h.key for h in handles if h.key in self._live]))

    async def evidence(self) -> dict:
        future = self.loop.create_future()
        call_id = id(future)
        self._calls[call_id] = future
        self._send(("evidence", call_id))
        return await future

    # --- messages from the engine

    def _read(self) -> None:
        """The reader thread: hands each message to the event loop. The pipe's end after a clean stop
        ends it quietly; any other end is a failure (waited for here, not on the event loop)."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the pipe closed without a word: the process ended
                self.proc.join(timeout=5)
                if self.proc.exitcode == 0:
                    return
                message = ("failed", f"the engine process died (exit code {self.proc.exitcode})")
            try:
                self.loop.call_soon_threadsafe(self._on_message, message)
            except RuntimeError:  # the event loop has closed: the server is shutting down
                return
            if message[0] == "failed":
                return

    def _on_message(self, message) -> None:
        kind = message[0]
        if kind == "step":
            self._on_step(message[1])
            self.counters = message[2]
        elif kind == "aborted":
            self.counters = message[2]
            for key in message[1]:
                h = self._live.pop(key, None)
                if h is not None:
                    self.in_server -= 1
                    h.sink.put_nowait(None)
        elif kind == "reply":
            future = self._calls.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "ready":
            self.ready.set()
        elif kind == "failed":
            self._engine_failed(message[1])

    def _on_step(self, outputs) -> None:
        for key, new_ids, made, when, finish_reason, final_text, prompt_tokens in outputs:
            h = self._live.get(key)
            if h is None:
                continue
            h.output_ids.extend(new_ids)
            if finish_reason is not None:
                del self._live[key]
                self.in_server -= 1
                self.m_generated_tokens += made
                rest, ok = h.stream.finish(final_text)
                if not ok:
                    self.m_text_mismatch += 1
                h.sink.put_nowait(Event(h.index, rest, made, when, finish_reason, prompt_tokens))
            else:
                piece = h.stream.advance(h.output_ids)
                if piece:
                    h.sink.put_nowait(Event(h.index, piece, made, when))

    def _engine_failed(self, message: str) -> None:
        if self.failed is not None:
            return
        self.failed = message
        self.ready.set()
        for h in self._live.values():
            h.sink.put_nowait(None)
        self.in_server -= len(self._live)
        self._live.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ApiError(503, f"engine failed: {message}", "engine_failed"))
        self._calls.clear()
        if self.on_failure is not None:
            self.on_failure()
