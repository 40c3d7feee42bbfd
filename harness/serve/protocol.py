"""`moebench serve`'s requests: the OpenAI-style error a refused request gets, and the parser that
checks a request body against what the runtime can do (anything else is a 400)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ApiError(Exception):
    """A request the server refuses: HTTP status plus the OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_ or {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                              429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def _bad(message: str, code: str = "invalid_parameter") -> ApiError:
    return ApiError(400, message, code)


@dataclass
class Parsed:
    prompts: list[list[int]]
    max_tokens: int
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str
    sampling: object = None  # moebench.engine.sampling.SamplingParams


def _field(body: dict, name: str, kinds, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise _bad(f"'{name}' has the wrong type ({type(value).__name__})")
    return value


def _as_tuple(kinds):
    return kinds if isinstance(kinds, tuple) else (kinds,)


class RequestParser:
    """Checks a request body against what the runtime can do; anything else is a 400."""

    def __init__(self, tokenizer, vocab_size: int, served_model: str, max_model_len: int, default_max_tokens: int,
                 chat_template, default_sampling=None):
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self.default_sampling = default_sampling  # the server's --temperature/--top-p/--top-k (None: greedy)

    def parse(self, body, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", "invalid_body")
        model = _field(body, "model", str, self.served_model)
        if model != self.served_model:
            raise ApiError(404, f"model '{model}' does not exist (this server serves '{self.served_model}')",
                           "model_not_found")
        sampling = self._sampling(body)
        if chat:
            prompts = [self._chat_prompt(body.get("messages"))]
            limit = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompts = self._prompts(body.get("prompt"))
            limit = body.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise _bad(f"max_tokens must be a positive integer, got {limit!r}")
        longest = max(len(p) for p in prompts)
        room = self.max_model_len - longest
        if room < 1:
            raise _bad(f"the prompt has {longest} tokens; this model's context is {self.max_model_len}",
                       "context_length_exceeded")
        max_tokens = min(self.default_max_tokens, room) if limit is None else limit
        if max_tokens > room:
            raise _bad(f"prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds the model's context "
                       f"of {self.max_model_len} tokens", "context_length_exceeded")
        stream = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, {})
        if options and not stream:
            raise _bad("stream_options is only allowed with stream: true")
        return Parsed(prompts, max_tokens, self._stops(body.get("stop")), stream,
                      bool(options.get("include_usage", False)), model, sampling)

    def _sampling(self, body: dict):
        """The request's SamplingParams (engine/sampling.py); what is not given comes from the server's
        defaults. top_k -1 or 0 means no cut (vLLM's and llama.cpp's convention)."""
        from moebench.engine.sampling import SamplingParams

        default = self.default_sampling or SamplingParams()
        temperature = _field(body, "temperature", (int, float), default.temperature)
        top_p = _field(body, "top_p", (int, float), default.top_p)
        top_k = _field(body, "top_k", int, default.top_k)
        if top_k in (-1, 0):
            top_k = None
        seed = _field(body, "seed", int)
        if seed is not None and not -(1 << 63) <= seed < (1 << 64):
            raise _bad(f"seed {seed}: must fit in 64 bits", "invalid_seed")
        if not (isinstance(temperature, (int, float)) and temperature >= 0 and temperature != float("inf")):
            raise _bad(f"temperature must be a finite number >= 0, got {temperature}", "invalid_sampling")
        if not 0 < top_p <= 1:
            raise _bad(f"top_p must be in (0, 1], got {top_p}", "invalid_sampling")
        if top_k is not None and top_k < 1:
            raise _bad(f"top_k must be >= 1, or -1 or 0 for no cut, got {top_k}", "invalid_sampling")
        for name in ("presence_penalty", "frequency_penalty"):
            if _field(body, name, (int, float), 0) != 0:
                raise _bad(f"{name} is not supported by this runtime", "unsupported_parameter")
        if _field(body, "repetition_penalty", (int, float), 1) != 1:
            raise _bad("repetition_penalty is not supported by this runtime", "unsupported_parameter")
        if _field(body, "n", int, 1) != 1 or _field(body, "best_of", int, 1) != 1:
            raise _bad("n and best_of must be 1 (one completion per prompt)", "unsupported_parameter")
        if _field(body, "echo", bool, False):
            raise _bad("echo is not supported by this runtime", "unsupported_parameter")
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise _bad("logprobs are not supported by moebench serve (for loglikelihood tasks use "
                       "`moebench lm-eval`, which runs the model in-process)", "unsupported_parameter")
        if body.get("logit_bias"):
            raise _bad("logit_bias is not supported by this runtime", "unsupported_parameter")
        if temperature == 0:  # greedy: nothing is drawn, so top_p, top_k and seed change nothing
            return SamplingParams()
        if seed is None:  # as OpenAI's API: no seed, no promise of the same tokens twice
            import secrets

            seed = secrets.randbits(63)
        return SamplingParams(float(temperature), float(top_p), top_k, seed & ((1 << 64) - 1))

    def _prompts(self, prompt) -> list[list[int]]:
        if prompt is None:
            raise _bad("'prompt' is required", "missing_prompt")
        if isinstance(prompt, str):
            return [self._text(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [self._ids(prompt)]
            if all(isinstance(p, str) for p in prompt):
                return [self._text(p) for p in prompt]
            if all(isinstance(p, list) for p in prompt):
                return [self._ids(p) for p in prompt]
        raise _bad("'prompt' must be a string, a list of token ids, or a list of either", "invalid_prompt")

    def _text(self, text: str) -> list[int]:
        if not text:
            raise _bad("the prompt is empty", "invalid_prompt")
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise _bad("the prompt encodes to no tokens", "invalid_prompt")
        return ids

    def _ids(self, ids: list) -> list[int]:
        if not ids:
            raise _bad("a token-id prompt is empty", "invalid_prompt")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise _bad(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})", "invalid_prompt")
        return list(ids)

    def _stops(self, stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise _bad("'stop' must be a non-empty string or a list of up to 16 of them", "invalid_stop")
        return tuple(stop)

    def _chat_prompt(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "invalid_messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise _bad("each message needs a string 'role' and a string 'content'", "invalid_messages")
        if self.chat_template is not None:
            text = self.chat_template.render(messages=messages, add_generation_prompt=True)
        else:  # no template shipped with the model: the messages' contents, one per line
            text = "\n".join(m["content"] for m in messages)
        return self._text(text)


def load_chat_template(model_dir: Path):
    """The model's chat template (tokenizer_config.json `chat_template`), compiled, or None."""
    f = model_dir / "tokenizer_config.json"
    if not f.is_file():
        return None
    template = json.loads(f.read_text()).get("chat_template")
    if not isinstance(template, str):
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
