"""`moebench serve`: the bundled runtime (or any supported checkpoint) behind an OpenAI-compatible
HTTP API, with the same switches as `moebench run`.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(both with `stream`, server-sent events ending in `data: [DONE]`, and a last chunk with `usage` when
`stream_options.include_usage` is set), `GET /v1/moebench/evidence` (the engine's activation
evidence, switches and backend names) and `GET /metrics` (Prometheus text format).

The engine (model, KV cache, scheduler) runs in a process of its own (`moebench.serve.core`),
forked before the server starts and fed through a pipe, as vLLM's API server feeds its engine
core: torch never runs in the process of the event loop, and no GIL is shared between stepping the
engine and serving HTTP. Requests join the scheduler between steps, so `--scheduler continuous`
admits them into the running batch at the next step, while `static` batches what arrived together
and starts the next batch when this one ends. After each step the engine sends the new token ids of
every sequence in one message; the front end detokenizes them and each response streams its pieces
as they come.

Decoding is greedy unless a request (or the server's --temperature default) asks for sampling:
`temperature`, `top_p`, `top_k` and OpenAI's `seed` are honoured, and a request with a seed gets
the tokens `moebench run` gets in-process for that seed (engine/sampling.py; without a seed the
server draws one). Anything the runtime cannot honour gets a 400 (the parser:
`moebench.serve.protocol`). Limits: prompt plus max_tokens within `--max-model-len`, at most
`--max-queue` requests in the server at once (more get a 429), request bodies up to 4 MiB.
"""


import json
import sys
import time
import uuid
from pathlib import Path


from moebench.serve.protocol import ApiError, RequestParser, _bad
from moebench.serve.client import EngineClient, Event, Handle
from moebench.serve.stream import TextStream

MAX_BODY_BYTES = 4 << 20

# ----------------------------------------------------------------------------- the HTTP app


def build_app(serving: EngineClient, parser: RequestParser, served_model: str, log_requests: bool = False):
    import asyncio
    import contextlib

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        serving.start(asyncio.get_running_loop())
        yield
        await asyncio.get_running_loop().run_in_executor(None, serving.stop)

    app = FastAPI(title="moebench serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    created = int(time.time())

    def error_response(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(ApiError(e.status_code, str(e.detail), code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return error_response(_bad(str(e), "invalid_request"))

    @app.get("/health")
    async def health():
        if serving.failed is not None:
            return error_response(ApiError(503, f"engine failed: {serving.failed}", "engine_failed"))
        if not serving.ready.is_set():
            return error_response(ApiError(503, "warming up", "not_ready"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                            "owned_by": "moebench", "max_model_len": parser.max_model_len}]}

    @app.get("/v1/moebench/evidence")
    async def evidence():
        _ready_or_raise(serving)
        return await serving.evidence()

    @app.get("/metrics")
    async def metrics():
        s = serving
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP moebench:{name} {help_}")
            lines.append(f"# TYPE moebench:{name} {kind}")
            for labels, value in samples:
                lines.append(f"moebench:{name}{labels} {value}")

        c = s.counters
        metric("requests_total", "counter", "Requests (one per prompt) by outcome.",
               [('{outcome="ok"}', c["ok"]), ('{outcome="aborted"}', c["aborted"]),
                ('{outcome="rejected"}', s.m_rejected)])
        metric("prompt_tokens_total", "counter", "Prompt tokens accepted.", [("", s.m_prompt_tokens)])
        metric("generated_tokens_total", "counter", "Tokens generated for finished requests.",
               [("", s.m_generated_tokens)])
        metric("engine_steps_total", "counter", "Engine steps run.", [("", c["steps"])])
        metric("decode_tokens_total", "counter", "Tokens made by decode steps.", [("", c["decode_tokens"])])
        metric("decode_seconds_total", "counter", "Wall time of decode steps.", [("", f"{c['decode_s']:.6f}")])
        metric("prefill_tokens_total", "counter", "Prompt tokens run by prefill steps.", [("", c["prefill_tokens"])])
        metric("prefill_seconds_total", "counter", "Wall time of prefill steps.", [("", f"{c['prefill_s']:.6f}")])
        metric("engine_idle_seconds_total", "counter", "Time the engine process waited with no request to run.",
               [("", f"{c['idle_s']:.6f}")])
        metric("requests_in_server", "gauge", "Requests accepted and not finished.", [("", s.in_server)])
        metric("stream_text_mismatch_total", "counter",
               "Requests whose streamed pieces were not a prefix of the final text (a bug if not 0).",
               [("", s.m_text_mismatch)])
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    generation_routes = {"/v1/completions": False, "/v1/chat/completions": True}

    @app.api_route("/v1/completions", methods=["GET", "PUT", "PATCH", "DELETE"])
    @app.api_route("/v1/chat/completions", methods=["GET", "PUT", "PATCH", "DELETE"])
    async def generation_wrong_method():  # POST goes to `generation` below, before FastAPI's routing
        raise ApiError(405, "use POST", "method_not_allowed")

    async def generation(scope, receive, send):
        """POST /v1/completions and /v1/chat/completions as plain ASGI, below FastAPI's routing and
        middleware: every streamed piece is one `send`, and their layers cost more than the piece."""
        chat = generation_routes[scope["path"]]
        try:
            body = await _read_body(receive)
            _ready_or_raise(serving)
            parsed = parser.parse(body, chat)
            if serving.in_server + len(parsed.prompts) > serving.max_queue:
                serving.m_rejected += len(parsed.prompts)
                raise ApiError(429, f"the server holds {serving.in_server} requests (limit {serving.max_queue}); "
                               "retry later", "queue_full")
        except ApiError as e:
            await _send_json(send, e.status, e.body())
            return
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        sink: asyncio.Queue = asyncio.Queue()
        handles = [Handle(i, sink, ids, parsed.max_tokens, parsed.stops, TextStream(serving.tokenizer, parsed.stops),
                          parsed.sampling)
                   for i, ids in enumerate(parsed.prompts)]
        serving.submit(handles)
        if log_requests:
            print(f"moebench serve: {rid} {len(handles)} prompt(s), max_tokens {parsed.max_tokens}, "
                  f"stream {parsed.stream}", file=sys.stderr, flush=True)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, sink))
        done = False
        try:
            if parsed.stream:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        (b"cache-control", b"no-cache")]})
                try:
                    async for piece in _stream(handles, sink, rid, chat, parsed):
                        await send({"type": "http.response.body", "body": piece.encode(), "more_body": True})
                except ClientGone:
                    return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                done = True
            else:
                try:
                    finals = await _collect(handles, sink)
                except ApiError as e:
                    await _send_json(send, e.status, e.body())
                    return
                done = finals is not None
                if done:
                    await _send_json(send, 200, _full_response(rid, chat, parsed, finals))
        finally:
            watcher.cancel()
            if not done:  # the client went away (or the engine failed): free the engine's slots
                serving.abort(handles)

    async def _read_body(receive) -> object:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(400, "the client went away", "disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", "body_too_large")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the body is not valid JSON ({e})", "invalid_json") from None

    async def _watch_disconnect(receive, sink) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        sink.put_nowait(DISCONNECTED)

    async def _send_json(send, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def _collect(handles, sink):
        """The choices' whole texts, or None when the client went away."""
        texts = [[] for _ in handles]
        finals: list[Event | None] = [None] * len(handles)
        left = len(handles)
        while left:
            event = await sink.get()
            if event is DISCONNECTED:
                return None
            if event is None:  # the engine took it out
                raise _taken_out(serving)
            texts[event.index].append(event.text)
            if event.finish_reason is not None:
                finals[event.index] = Event(event.index, "".join(texts[event.index]), event.tokens,
                                            event.token_time_s, event.finish_reason, event.prompt_tokens)
                left -= 1
        return finals

    def _full_response(rid, chat, parsed, finals):
        usage = {"prompt_tokens": sum(f.prompt_tokens for f in finals),
                 "completion_tokens": sum(f.tokens for f in finals)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if chat:
            choices = [{"index": f.index, "message": {"role": "assistant", "content": f.text},
                        "finish_reason": f.finish_reason, "logprobs": None} for f in finals]
            obj = "chat.completion"
        else:
            choices = [{"index": f.index, "text": f.text, "finish_reason": f.finish_reason, "logprobs": None}
                       for f in finals]
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": parsed.model,
                "choices": choices, "usage": usage}

    async def _stream(handles, sink, rid, chat, parsed):
        """Server-sent events. Pieces that arrived together go out in one write. Raises ClientGone
        when the client goes away (the caller then aborts the requests)."""
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": int(time.time()), "model": parsed.model}, separators=(",", ":"))[:-1]
        if chat:
            def chunk(index, text, finish):
                delta = {"content": text} if finish is None else ({"content": text} if text else {})
                return ("data: " + head + ',"choices":[' + json.dumps(
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish},
                    separators=(",", ":")) + "]}\n\n")
        else:
            def chunk(index, text, finish):
                return ('data: ' + head + ',"choices":[{"index":' + str(index) + ',"text":' + json.dumps(text)
                        + ',"logprobs":null,"finish_reason":' + json.dumps(finish) + "}]}\n\n")

        finished = 0
        prompt_tokens = completion_tokens = 0
        if chat:
            yield "".join("data: " + head + ',"choices":[' + json.dumps(
                {"index": h.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}, separators=(",", ":")) + "]}\n\n" for h in handles)
        while finished < len(handles):
            event = await sink.get()
            out = []
            while True:
                if event is DISCONNECTED:
                    raise ClientGone
                if event is None:  # the engine took it out
                    out.append("data: " + json.dumps(_taken_out(serving).body()) + "\n\n")
                    finished = len(handles)
                    break
                if event.finish_reason is not None:
                    finished += 1
                    prompt_tokens += event.prompt_tokens
                    completion_tokens += event.tokens
                    if event.text and chat:
                        out.append(chunk(event.index, event.text, None))
                        out.append(chunk(event.index, "", event.finish_reason))
                    else:
                        out.append(chunk(event.index, event.text, event.finish_reason))
                else:
                    out.append(chunk(event.index, event.text, None))
                try:
                    event = sink.get_nowait()
                except asyncio.QueueEmpty:
                    break
            yield "".join(out)
        tail = ""
        if parsed.include_usage:
            tail = ("data: " + head + ',"choices":[],"usage":' + json.dumps(
                {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}) + "}\n\n")
        yield tail + "data: [DONE]\n\n"

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in generation_routes:
            await generation(scope, receive, send)
        else:
            await app(scope, receive, send)

    return asgi


DISCONNECTED = object()  # put in a response's queue when its client goes away


class ClientGone(Exception):
    pass


def _taken_out(serving: EngineClient) -> ApiError:
    if serving.failed is not None:
        return ApiError(503, f"engine failed: {serving.failed}", "engine_failed")
    return ApiError(503, "the request was aborted", "aborted")


def _ready_or_raise(serving: EngineClient) -> None:
    if serving.failed is not None:
        raise ApiError(503, f"engine failed: {serving.failed}", "engine_failed")
    if not serving.ready.is_set():
        raise ApiError(503, "the engine is warming up; wait for /health", "not_ready")


# ----------------------------------------------------------------------------- the command


# ----------------------------------------------------------------------------- a child server


class ServeProcess:
    """`moebench serve ARGS` as a child process on a free loopback port, for tests and benchmarks:
    `with ServeProcess([...]) as server: server.url`. It is a `ServerProcess` (moebench.backends):
    its own process group, killed with its group when the block is left, whatever happened inside."""

    def __init__(self, args: list[str], startup_timeout_s: float = 180.0, log_path: Path | None = None):
        self.args = list(args)
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.server = None

    def __enter__(self) -> "ServeProcess":
        import tempfile

        from moebench.backends.profiles import Profile
        from moebench.backends.server import Placeholders, ServerProcess

        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="moebench-serve-", suffix=".log")[1])
        command = (sys.executable, "-m", "moebench", "serve", "--host", "{host}", "--port", "{port}", *self.args)
        self.server = ServerProcess(Profile("serve", command, env={"PYTHONUNBUFFERED": "1"}),
                                    Placeholders("127.0.0.1", None, None, None), self.log_path, "/health",
                                    self.startup_timeout_s)
        self.server.start()
        return self

    @property
    def url(self) -> str:
        return self.server.base_url

    @property
    def proc(self):
        return self.server.proc

    def log_tail(self, chars: int = 2000) -> str:
        return self.server.log_text()[-chars:]

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()
