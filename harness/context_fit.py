"""Does every prompt of a suite, plus the tokens asked for, fit the model's context?

One check for every path that sends prompts (`moebench run` on the bundled runtime or a server,
`moebench lm-eval`): a prompt that does not fit is refused before any work, naming the longest
prompt, the context and the suite/model pair, because a model fed past its context produces
garbage that scores as a wrong answer, not as an error."""

from __future__ import annotations

from dataclasses import dataclass

from moebench.errors import MoebenchError


@dataclass(frozen=True)
class Longest:
    tokens: int
    item_id: str


def longest_prompt(suite, encode_batch) -> Longest:
    """The suite's longest prompt in tokens; `encode_batch` maps a list of texts to lists of ids."""
    items = list(suite.items)
    lengths = [len(ids) for ids in encode_batch([suite.prompt(item) for item in items])]
    i = max(range(len(items)), key=lengths.__getitem__)
    return Longest(lengths[i], items[i].id)


def tokenizer_encoder(tokenizer):
    """`encode_batch` for a `tokenizers.Tokenizer`, one text at a time as the engines encode them
    (its encode_batch would pad to the batch's longest where the tokenizer asks for padding)."""
    return lambda texts: [tokenizer.encode(text).ids for text in texts]


def check_fits(longest_tokens: int, max_new_tokens: int, context: int, what: str, *,
               item_id: str | None = None, hint: str = "") -> None:
    """Refuse when a prompt of `longest_tokens` plus `max_new_tokens` exceeds `context`."""
    need = longest_tokens + max_new_tokens
    if need <= context:
        return
    which = f" (item {item_id})" if item_id else ""
    raise MoebenchError(
        f"{what}: the longest prompt{which} has {longest_tokens} tokens; with {max_new_tokens} new tokens "
        f"that is {need}, beyond the model's context of {context} tokens" + (f"; {hint}" if hint else ""))


def check_suite_fits(suite, encode_batch, max_new_tokens: int, context: int, model_name: str,
                     hint: str = "") -> Longest:
    longest = longest_prompt(suite, encode_batch)
    check_fits(longest.tokens, max_new_tokens, context, f"suite {suite.name} on model {model_name}",
               item_id=longest.item_id, hint=hint)
    return longest


def run_hint(suite) -> str:
    """What `moebench run` can change to make the prompts fit."""
    shots = f"fewer few-shot examples (--num-fewshot, now {suite.num_fewshot}), " if suite.num_fewshot else ""
    return f"use {shots}a smaller --max-new-tokens, or a model with a longer context"


def server_context(base_url: str, timeout_s: float = 10.0) -> int | None:
    """The context a running server reports, or None where it reports none: vLLM, SGLang and
    `moebench serve` give `max_model_len` in /v1/models, llama-server its slot's `n_ctx` in
    /v1/models' `meta` and in /props. Only a number the server states is used; none is guessed."""
    import httpx

    base = base_url.rstrip("/")
    try:
        data = httpx.get(base + "/v1/models", timeout=timeout_s).json().get("data") or []
        for model in data:
            if not isinstance(model, dict):
                continue
            value = model.get("max_model_len") or (model.get("meta") or {}).get("n_ctx")
            if isinstance(value, int) and value > 0:
                return value
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    try:
        props = httpx.get(base + "/props", timeout=timeout_s)
        if props.status_code == 200:
            settings = props.json().get("default_generation_settings") or {}
            value = settings.get("n_ctx")
            if isinstance(value, int) and value > 0:
                return value
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None
