"""The bundled runtime as an lm-eval model, registered as `moebench`, and the local task files.

    lm_eval.simple_evaluate(model="moebench", model_args="kernel=fused,scheduler=continuous", ...)

`generate_until` runs every request of a generation setting through one `Engine.generate`, so the
scheduler batches them exactly as `moebench run` does; decoding is greedy unless the task's
generation settings ask for sampling (`do_sample`, `temperature`, `top_p`, `top_k`), which runs
engine/sampling.py with a seed per request from (model_args `seed`, repeat, task and document). `loglikelihood` scores context + continuation with one
prefill that keeps the logits of every position (`EngineSession.token_logprobs`).
`loglikelihood_rolling` (perplexity tasks) is not offered.

Importing this module imports lm_eval (registration is a decorator); `moebench lm-eval` imports it
only when it runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm-eval fills its model registry only while it is empty: its own first)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from moebench.context_fit import check_fits
from moebench.errors import MoebenchError
import moebench.suites as suites_package

TASK_TEMPLATES = Path(suites_package.__file__).resolve().parent / "lm_eval"


def _task_templates() -> Path:
    from importlib.resources import files

    try:
        return Path(str(files("moebench.suites") / "lm_eval"))
    except ModuleNotFoundError:
        return TASK_TEMPLATES


def _bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("moebench")
class MoebenchLM(LM):
    """model_args: model (checkpoint dir; default the bundled model), kernel, scheduler, prefetch,
    batch_size, max_gen_toks (default 256), expert_budget, offload_tier, admission, device, threads,
    seed (of the sampling streams; default 0), weights (f32 or int8, --weights)."""

    def __init__(self, model: str | None = None, kernel: str = "naive", scheduler: str = "static",
                 prefetch: str = "off", batch_size: int | str = 16, max_gen_toks: int = 256,
                 expert_budget: str | float = "1.0", offload_tier: str = "host", admission: str = "affinity",
                 device: str = "cpu", threads: int | None = 1, seed: int | str = 0, weights: str = "f32", **unused):
        super().__init__()
        import torch

        from moebench.engine import Engine, RuntimeConfig
        from moebench.engine.overrides import Overrides
        from moebench.measuring.run import _load_model, _parse_budget, bundled_model_path

        if unused:
            raise MoebenchError(f"moebench lm-eval model: unknown model_args {', '.join(sorted(unused))}")
        if str(batch_size).startswith("auto"):
            batch_size = 16
        self.runtime = RuntimeConfig(kernel=kernel, scheduler=scheduler, prefetch=prefetch, device=device,
                                     batch_size=int(batch_size), max_new_tokens=int(max_gen_toks),
                                     admission=admission, expert_budget=_parse_budget(str(expert_budget)),
                                     offload_tier=offload_tier, weights=weights,
                                     overrides=Overrides.from_environment(os.environ))  # read once, here
        if threads:
            torch.set_num_threads(int(threads))
        self.model_path = Path(model) if model else bundled_model_path()
        ckpt, tokenizer = _load_model(self.model_path, self.runtime)
        self.engine = Engine(ckpt, tokenizer, self.runtime)
        self.max_length = ckpt.config.max_position_embeddings
        self.activation_errors: list[str] = []
        self.evidence: list[dict] = []
        self.seed = int(seed)
        self._draws: dict[str, int] = {}  # (task, document) -> requests seen: repeats get new seeds
        self._scorer = None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "MoebenchLM":
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k == "batch_size"}
        return cls(**{**extra, **args})

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from moebench.engine import Request

        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, instance in enumerate(requests):
            context, gen_kwargs = instance.args[0], dict(instance.args[1])
            until = gen_kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_gen = int(gen_kwargs.pop("max_gen_toks", self.runtime.max_new_tokens))
            sampling = self._sampling(gen_kwargs, instance, i)
            if gen_kwargs:
                raise MoebenchError(f"moebench lm-eval model: unsupported generation settings {sorted(gen_kwargs)}")
            settings.append((context, tuple(until), max_gen, sampling))
            groups.setdefault((tuple(until), max_gen), []).append(i)

        outputs: list[str | None] = [None] * len(requests)
        for (until, max_gen), indices in groups.items():
            batch = [Request(str(i), settings[i][0], max_gen, until, settings[i][3]) for i in indices]
            check_fits(max(len(self.engine.encode(r.prompt)) for r in batch), max_gen, self.max_length,
                       "moebench lm-eval model", hint="use fewer few-shot examples (--num-fewshot)")
            result = self.engine.generate(batch)
            self.evidence.append(result.evidence)
            if len(batch) > self.runtime.batch_size:
                self.activation_errors += result.activation_errors
            for c in result.completions:
                outputs[int(c.id)] = c.text
                self.cache_hook.add_partial("generate_until", (settings[int(c.id)][0], {"until": list(until)}), c.text)
        return outputs

    def _sampling(self, gen_kwargs: dict, instance, index: int):
        """The request's SamplingParams from lm-eval's (Hugging Face style) generation settings. A
        contradiction (do_sample false with a temperature, or true with temperature 0) is refused,
        never quietly resolved one way."""
        from moebench.engine.sampling import GREEDY, SamplingParams, check_sampling, request_seed

        do_sample = gen_kwargs.pop("do_sample", None)
        temperature = gen_kwargs.pop("temperature", None)
        top_p, top_k = gen_kwargs.pop("top_p", None), gen_kwargs.pop("top_k", None)
        temperature = None if temperature is None else float(temperature)
        if do_sample is not None and not _bool(do_sample):
            if temperature:
                raise MoebenchError(f"moebench lm-eval model: do_sample=false with temperature={temperature} "
                                    "(set do_sample=true to sample)")
            return GREEDY
        if do_sample is not None and temperature is None:
            temperature = 1.0  # Hugging Face's default when sampling
        if not temperature:
            if do_sample is not None:
                raise MoebenchError("moebench lm-eval model: do_sample=true with temperature=0")
            return GREEDY
        top_p = 1.0 if top_p is None else float(top_p)
        top_k = None if top_k in (None, 0, -1) else int(top_k)
        check_sampling(temperature, top_p, top_k, "moebench lm-eval model: ")
        doc = f"{getattr(instance, 'task_name', None)}:{getattr(instance, 'doc_id', index)}"
        repeat = self._draws.get(doc, 0)
        self._draws[doc] = repeat + 1
        return SamplingParams(temperature, top_p, top_k, request_seed(self.seed, repeat, doc))

    # ------------------------------------------------------------------ scoring

    def _session(self):
        if self._scorer is None:
            self._scorer = self.engine.session(self.max_length)
        return self._scorer

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = []
        for instance in requests:
            context, continuation = instance.args
            ctx_ids, cont_ids = self._split(context, continuation)
            ids = ctx_ids + cont_ids
            if len(ids) > self.max_length:
                raise MoebenchError(f"moebench lm-eval model: {len(ids)} tokens exceed the model's context of "
                                    f"{self.max_length}")
            logprobs, greedy = self._session().token_logprobs(ids)
            tail = slice(len(ctx_ids) - 1, None)
            results.append((float(sum(logprobs[tail])), bool(all(greedy[tail]))))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), results[-1])
        return results

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokens of context and continuation as lm-eval splits them: spaces at the end of the
        context move to the continuation, the whole is encoded once and the continuation is its
        tail (so a token that spans the boundary is not split differently than in generation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            raise MoebenchError("moebench lm-eval model: loglikelihood needs a non-empty context")
        whole = self.engine.encode(context + continuation)
        ctx = self.engine.encode(context)
        if not ctx:
            raise MoebenchError("moebench lm-eval model: the context encodes to no tokens")
        return whole[: len(ctx)], whole[len(ctx):]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise MoebenchError("moebench lm-eval model: loglikelihood_rolling (perplexity tasks) is not supported; "
                            "generation (generate_until) and loglikelihood tasks are")

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None


# ---------------------------------------------------------------------- local task files


def gsm8k_data_dir(data: Path | None) -> Path | None:
    """--data, else $MOEBENCH_GSM8K_DIR, else None (lm-eval's hub task)."""
    chosen = data or (Path(os.environ["MOEBENCH_GSM8K_DIR"]) if os.environ.get("MOEBENCH_GSM8K_DIR") else None)
    if chosen is not None:
        for name in ("train.jsonl", "test.jsonl"):
            if not (chosen / name).is_file():
                raise MoebenchError(f"{chosen / name}: no such file (a GSM8K directory holds train.jsonl and test.jsonl)")
    return chosen


def render_tasks(out_dir: Path, gsm8k_dir: Path | None) -> list[str]:
    """Write the task files of suites/lm_eval/ into `out_dir`, their paths filled in: gsm_synth
    always (its items written beside it as JSONL), gsm8k_local when a GSM8K directory is given.
    Returns the task names written."""
    import json

    import lm_eval

    from moebench.suites.synth import load_synth_items

    gsm8k_yaml = Path(lm_eval.__file__).resolve().parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    if not gsm8k_yaml.is_file():
        raise MoebenchError(f"{gsm8k_yaml}: lm-eval's gsm8k task file is missing (reinstall lm-eval)")
    out_dir.mkdir(parents=True, exist_ok=True)
    templates = _task_templates()
    written = []

    synth_dir = out_dir / "gsm_synth_data"
    synth_dir.mkdir(exist_ok=True)
    test, shots = load_synth_items("test", None)  # the 1,000 test items; the suite's 64 few-shot items
    for split, items in (("train", shots), ("test", test)):
        (synth_dir / f"{split}.jsonl").write_text(
            "".join(json.dumps({"question": i.question, "answer": i.answer}) + "\n" for i in items))
    jobs = [("gsm_synth", synth_dir)]
    if gsm8k_dir is not None:
        jobs.append(("gsm8k_local", Path(gsm8k_dir).resolve()))
    for name, data_dir in jobs:
        text = (templates / f"{name}.yaml").read_text()
        text = text.replace("{gsm8k_yaml}", str(gsm8k_yaml)).replace("{data_dir}", str(data_dir))
        (out_dir / f"{name}.yaml").write_text(text)
        written.append(name)
    return written
