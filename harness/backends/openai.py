"""An OpenAI-compatible server as an engine: the suite's prompts over `/v1/completions` (or
`/v1/chat/completions`), streamed, with bounded concurrency.

Per request: TTFT, the arrival time of every streamed chunk (inter-token latencies, TPOT),
end-to-end latency, output tokens (the usage field, else one per content chunk) and the finish
reason. Per run, as vLLM's `bench serve` and SGLang's `bench_serving` define them: output
throughput = output tokens / benchmark duration, request throughput = completed requests /
duration. Decode throughput = tokens after each request's first / the wall time during which
at least one request was past its first token (docs/engines.md).

Failures are never dropped: a request that fails after its retries becomes a completion with
`error` set, and is counted and shown in the report.

Closed loop (no `arrivals`): every request is queued at the start, at most `concurrency` in
flight. Open loop (`arrivals`, send offsets in seconds from the trial's start, as
`moebench.measuring.arrivals.Load.offsets` draws them): each request is sent at its offset
whatever is still in flight, as vLLM's `bench serve --request-rate` does; how late the client
itself was is `sent_s - scheduled_s` (docs/open-loop-client.md). TTFT, inter-token latencies and
latency are counted from the actual send in both.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable

RETRYABLE_STATUS = (429, 500, 502, 503, 504)


@dataclass
class HttpCompletion:
    id: str
    text: str
    output_tokens: int
    prompt_tokens: int | None
    finish_reason: str | None
    ttft_s: float | None
    latency_s: float | None
    token_times: list[float]  # seconds since the request was sent, one per content chunk
    error: str | None = None
    attempts: int = 1
    sent_at: float = 0.0  # perf_counter when the (last) attempt was sent
    scheduled_s: float | None = None  # open loop: the arrival offset from the trial's start; closed loop: None
    sent_s: float | None = None  # when the first attempt was sent, seconds from the trial's start

    @property
    def output_ids(self) -> list[int]:  # what the in-process engine's completions carry
        return []

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class HttpResult:
    completions: list[HttpCompletion]
    evidence: dict
    activation_errors: list[str]
    wall_s: float
    decode_tokens: int
    decode_s: float
    prefill_tokens: int
    prefill_s: float
    server_exit: int | None = None  # the server's exit code if it died during the run
    steps: list = field(default_factory=list)
    expert_load: list = field(default_factory=list)

    @property
    def failed_requests(self) -> int:
        return sum(c.error is not None for c in self.completions)

    def phase_totals(self, phase_tokens: str, phases: tuple[str, ...]) -> tuple[int, float]:
        if "decode" in phases:
            return self.decode_tokens, self.decode_s
        return self.prefill_tokens, self.prefill_s


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


SPIN_S = 0.001  # how long before a send the dispatcher stops sleeping and starts yielding


async def _wait_until(deadline: float) -> None:
    """Return at `deadline` (perf_counter seconds), not up to a millisecond or more after it: the
    event loop's timers round their timeouts up to whole milliseconds and fire only between
    batches of I/O callbacks, so the timer wakes the dispatcher SPIN_S early and it yields the
    rest away one loop iteration at a time, the streams' I/O still being served meanwhile."""
    early = deadline - time.perf_counter() - SPIN_S
    if early > 0:
        await asyncio.sleep(early)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)


def request_seed(run_seed: int, item_id: str) -> int:
    """A per-request sampling seed from (run seed, item id): two configurations stay paired
    item by item whatever order their requests run in."""
    return int(hashlib.sha256(f"{run_seed}:{item_id}".encode()).hexdigest()[:8], 16)


@dataclass
class ClientOptions:
    concurrency: int = 16
    chat: bool = False
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    request_timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 0.5


def server_root(base_url: str) -> str:
    """The server's root URL: `http://host:port`, also when given the OpenAI SDK's way, ending in /v1."""
    root = base_url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class OpenAIEngine:
    """One configuration of a running server. `server` (optional) is the process moebench
    started: its evidence is read after the work, and its death is reported."""

    def __init__(self, base_url: str, options: ClientOptions, served_model: str | None = None,
                 tokenizer=None, server=None, start_evidence: tuple[dict, list[str]] = ({}, [])):
        self.base_url = server_root(base_url)
        self.options = options
        self.tokenizer = tokenizer
        self.server = server
        self.start_evidence = start_evidence
        self._context_checked = False
        self.served_model = served_model or self._first_model()

    def _first_model(self) -> str:
        import httpx

        from moebench.errors import MoebenchError

        try:
            r = httpx.get(self.base_url + "/v1/models", timeout=10.0)
        except httpx.TransportError as e:  # nothing answered: naming a model would not help
            raise MoebenchError(f"{self.base_url}: the server is unreachable ({type(e).__name__}: {e}); "
                                "is it running, on this host and port?") from None
        try:
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
            raise MoebenchError(f"{self.base_url}/v1/models: cannot read the served model ({type(e).__name__}); "
                                "give --served-model") from None

    # ------------------------------------------------------------ requests

    def _body(self, request) -> dict:
        o = self.options
        body: dict = {"model": self.served_model, "max_tokens": request.max_new_tokens, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": o.temperature}
        if o.chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        elif self.tokenizer is not None:  # token ids: the server's tokenizer cannot change the prompt
            body["prompt"] = self.tokenizer.encode(request.prompt).ids
        else:
            body["prompt"] = request.prompt
        if request.stop:
            body["stop"] = list(request.stop)
        if o.top_p is not None:
            body["top_p"] = o.top_p
        if o.top_k is not None:
            body["top_k"] = o.top_k
        if o.temperature > 0:  # the request's own seed (per trial: harness/measuring/measure.py), else one from the run seed
            sampling = getattr(request, "sampling", None)
            body["seed"] = sampling.seed if sampling is not None and not sampling.greedy \
                else request_seed(o.seed, request.id)
        return body

    async def _one(self, client, request, start: float, scheduled: float | None = None,
                   body: dict | None = None) -> HttpCompletion:
        import aiohttp

        o = self.options
        path = "/v1/chat/completions" if o.chat else "/v1/completions"
        body = self._body(request) if body is None else body
        error = None
        first_sent = None
        for attempt in range(1, o.retries + 2):
            sent = time.perf_counter()
            if first_sent is None:
                first_sent = sent - start
            times: list[float] = []
            text, finish, usage = [], None, None
            error, retry = None, False
            try:
                async with client.post(self.base_url + path, json=body) as response:
                    if response.status != 200:
                        detail = (await response.read()).decode(errors="replace")[:200]
                        error = f"HTTP {response.status}: {detail}"
                        retry = response.status in RETRYABLE_STATUS
                    else:
                        async for line in response.content:
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                break
                            chunk = json.loads(data)
                            if "error" in chunk:
                                error = f"server error: {json.dumps(chunk['error'])[:200]}"
                                break
                            usage = chunk.get("usage") or usage
                            for choice in chunk.get("choices") or []:
                                piece = (choice.get("delta") or {}).get("content") if o.chat else choice.get("text")
                                if piece:
                                    times.append(time.perf_counter() - sent)
                                    text.append(piece)
                                finish = choice.get("finish_reason") or finish
                        else:
                            if finish is None and error is None:
                                raise aiohttp.ClientPayloadError("the stream ended before [DONE]")
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
                error = f"{type(e).__name__}: {str(e)[:160]}"
                retry = not times  # a retry after tokens arrived would count them twice
            if error is None:
                end = time.perf_counter() - sent
                tokens = (usage or {}).get("completion_tokens") or len(times)
                return HttpCompletion(request.id, "".join(text), int(tokens), (usage or {}).get("prompt_tokens"),
                                      finish or "stop", times[0] if times else end, end, times,
                                      attempts=attempt, sent_at=sent, scheduled_s=scheduled, sent_s=first_sent)
            if not retry or attempt > o.retries or self._server_dead():
                break
            await asyncio.sleep(o.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
        return HttpCompletion(request.id, "", 0, None, "error", None, None, [], error=error,
                              attempts=attempt, sent_at=sent, scheduled_s=scheduled, sent_s=first_sent)

    def _server_dead(self) -> bool:
        return self.server is not None and self.server.exit_code is not None

    async def _run(self, requests, on_complete, arrivals: list[float] | None = None) -> tuple[list[HttpCompletion], float]:
        import aiohttp

        o = self.options
        open_loop = arrivals is not None
        # open loop: the prompts are tokenized before the trial, not on the loop as each one falls
        # due (a few-shot prompt takes over a millisecond, which its own send would wait for)
        bodies = [self._body(r) for r in requests] if open_loop else None
        # open loop: no cap on connections either, or the pool would queue sends as the semaphore does
        connector = aiohttp.TCPConnector(limit=0 if open_loop else o.concurrency, force_close=False)
        timeout = aiohttp.ClientTimeout(total=o.request_timeout_s, sock_connect=10.0)
        gate = asyncio.Semaphore(o.concurrency)
        done: list[HttpCompletion] = []

        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            def finished(completion):
                done.append(completion)
                if on_complete:
                    on_complete(completion)

            async def one(request):
                async with gate:
                    completion = await self._one(client, request, start)
                finished(completion)

            async def arriving(request, offset, body):
                finished(await self._one(client, request, start, offset, body))

            start = time.perf_counter()
            if not open_loop:
                await asyncio.gather(*(one(r) for r in requests))
            else:
                # A full collection stops the loop for as long as it takes to walk every object of
                # the process (tens of ms, more with a model's worth of modules loaded), and sends
                # due meanwhile go out that late: what exists now is set aside for the trial.
                frozen = gc.get_freeze_count() == 0
                gc.freeze()
                try:
                    # one dispatcher walks the schedule, so requests go out in its order even
                    # where offsets tie (the loop's timer heap does not keep ties in order)
                    tasks = []
                    for request, offset, body in zip(requests, arrivals, bodies):
                        await _wait_until(start + offset)
                        tasks.append(asyncio.create_task(arriving(request, offset, body)))
                    await asyncio.gather(*tasks)
                finally:
                    if frozen:
                        gc.unfreeze()
            wall = time.perf_counter() - start
        order = {r.id: i for i, r in enumerate(requests)}
        done.sort(key=lambda c: order[c.id])
        return done, wall

    def check_context(self, requests) -> None:
        """Refuse prompts that cannot fit the context the server reports (counted with the
        tokenizer the prompts are sent with; a chat template only adds to them)."""
        if self.tokenizer is None or not requests or self._context_checked:
            return
        from moebench.context_fit import check_fits, server_context

        context = server_context(self.base_url)
        self._context_checked = True
        if context is None:
            return
        lengths = [len(self.tokenizer.encode(r.prompt).ids) for r in requests]
        i = max(range(len(requests)), key=lambda j: lengths[j] + requests[j].max_new_tokens)
        check_fits(lengths[i], requests[i].max_new_tokens, context,
                   f"served model {self.served_model} at {self.base_url}", item_id=requests[i].id,
                   hint="use fewer few-shot examples (--num-fewshot), a smaller --max-new-tokens, or a server "
                        "with a longer context")

    def generate(self, requests, on_complete: Callable | None = None,
                 arrivals: list[float] | None = None) -> HttpResult:
        """Send the requests and collect their completions, in the requests' order. `arrivals`:
        open loop, one send offset per request (seconds from the trial's start, non-decreasing);
        None: closed loop at the options' concurrency. `on_complete` runs on the event loop that
        sends: work it does delays the sends due meanwhile."""
        if arrivals is not None:
            arrivals = [float(a) for a in arrivals]
            if len(arrivals) != len(requests):
                raise ValueError(f"{len(arrivals)} arrival offsets for {len(requests)} requests")
            if any(b < a for a, b in zip(arrivals, arrivals[1:])) or (arrivals and arrivals[0] < 0):
                raise ValueError("arrival offsets must be >= 0 and non-decreasing")
        self.check_context(requests)
        completions, wall = asyncio.run(self._run(requests, on_complete, arrivals))
        ok = [c for c in completions if c.error is None]
        decode = [(c.sent_at + c.ttft_s, c.sent_at + c.latency_s) for c in ok if c.output_tokens > 1]
        prefill = [(c.sent_at, c.sent_at + c.ttft_s) for c in ok]
        evidence, errors = self._evidence()
        return HttpResult(
            completions, evidence, errors, wall,
            decode_tokens=sum(max(c.output_tokens - 1, 0) for c in ok), decode_s=union_seconds(decode),
            prefill_tokens=sum(c.prompt_tokens or 0 for c in ok), prefill_s=union_seconds(prefill),
            server_exit=self.server.exit_code if self.server is not None else None,
        )

    def _evidence(self) -> tuple[dict, list[str]]:
        evidence = {"base_url": self.base_url, "served_model": self.served_model,
                    "prompt_as": "chat" if self.options.chat else ("token_ids" if self.tokenizer else "text")}
        if self.server is None:
            return evidence, []
        start_seen, start_errors = self.start_evidence
        end_seen, end_errors = self.server.evidence("end")
        evidence.update(profile=self.server.profile.name, argv=self.server.argv,
                        log=str(self.server.log_path), seen={**start_seen, **end_seen})
        if self.server.observed.not_exercised:  # evidence this workload gave no chance to show
            evidence["not_exercised"] = list(self.server.observed.not_exercised)
        return evidence, start_errors + end_errors
