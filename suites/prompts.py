"""Prompt formats as data: how a question is asked, with which few-shot examples, and
where generation stops.

Both formats reproduce lm-eval's tasks of the same name (lm-eval 0.4.x, no chat
template) to the character, so a model's accuracy here and there can be compared.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from importlib import resources

from moebench.errors import MoebenchError
from moebench.suites import extract
from moebench.suites.base import Item

# lm-eval's default few-shot seed (its `fewshot_random_seed`, DEFAULT_OTHER_SEED).
LMEVAL_FEWSHOT_SEED = 1234

# The gsm8k_cot exemplars, copied as data from lm-eval's gsm8k-cot.yaml.
COT_EXEMPLARS_FILE = "gsm8k_cot_exemplars.json"


@dataclass(frozen=True)
class PromptFormat:
    name: str
    question_template: str  # "{question}" is replaced by the item's question
    num_fewshot: int  # default number of examples
    stop: tuple[str, ...]
    strict_pattern: str  # the strict-match regex (see extract.py)
    # "seeded_random": a fresh draw from the pool for each item, one Random(seed) stream
    # over the items in order (lm-eval's default sampler). "first_n": the pool's first n.
    fewshot_sampler: str
    # What the answer is compared with: "solution" (the full reference solution, whose
    # "#### " prefix exact_match strips) or "final_answer" (the text after "####").
    reference: str
    exemplars_file: str | None = None  # a fixed few-shot pool shipped with moebench
    fewshot_seed: int = LMEVAL_FEWSHOT_SEED
    target_delimiter: str = " "  # between a shot's question and its answer
    fewshot_delimiter: str = "\n\n"  # after each shot

    def ask(self, question: str) -> str:
        return self.question_template.replace("{question}", question)

    def render(self, item: Item, fewshot: list[Item]) -> str:
        """The prompt: each shot answered, then the item's question left open."""
        shots = "".join(
            self.ask(shot.question) + self.target_delimiter + shot.answer + self.fewshot_delimiter
            for shot in fewshot
        )
        return shots + self.ask(item.question)

    def reference_for(self, item: Item) -> str:
        if self.reference == "solution":
            return item.answer
        return item.answer.split("####")[-1].strip()

    def exemplars(self) -> list[Item]:
        """The fixed few-shot pool, or [] when shots come from the data's train split."""
        return load_exemplars(self.exemplars_file) if self.exemplars_file else []

    def choose_fewshot(
        self, items: list[Item], pool: list[Item], num_fewshot: int, *, exclude_self: bool
    ) -> list[list[Item]]:
        """Few-shot examples for each item, in the order of `items`."""
        if num_fewshot == 0:
            # lm-eval does not touch its random stream when no shots are asked for.
            return [[] for _ in items]
        if self.fewshot_sampler == "first_n":
            return [_first_n(pool, num_fewshot, item if exclude_self else None) for item in items]
        if self.fewshot_sampler == "seeded_random":
            rnd = random.Random(self.fewshot_seed)
            return [_draw(rnd, pool, num_fewshot, item if exclude_self else None) for item in items]
        raise ValueError(f"unknown few-shot sampler {self.fewshot_sampler!r}")


def _same_row(a: Item, b: Item) -> bool:
    # lm-eval compares documents as dicts of their fields, not by id.
    return a.question == b.question and a.answer == b.answer


def _first_n(pool: list[Item], n: int, asked: Item | None) -> list[Item]:
    candidates = [shot for shot in pool if asked is None or not _same_row(shot, asked)]
    return candidates[:n]


def _draw(rnd: random.Random, pool: list[Item], n: int, asked: Item | None) -> list[Item]:
    """One draw of lm-eval's default sampler; consumes `rnd` exactly as it does."""
    if asked is None:
        return rnd.sample(pool, n)
    # Draw one spare so the asked item can be dropped if it was drawn.
    shots = [shot for shot in rnd.sample(pool, n + 1) if not _same_row(shot, asked)][:n]
    if len(shots) < n:  # the pool held copies of the asked item
        shots = rnd.sample([shot for shot in pool if not _same_row(shot, asked)], n)
    return shots


@functools.cache
def _exemplar_rows(filename: str) -> tuple[Item, ...]:
    path = resources.files("moebench.suites").joinpath(filename)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        stem = filename.removesuffix(".json")
        return tuple(
            Item(id=f"{stem}/{i}", question=row["question"], answer=row["answer"], target=row["target"])
            for i, row in enumerate(rows)
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MoebenchError(f"{path}: cannot read few-shot exemplars ({err})") from None


def load_exemplars(filename: str) -> list[Item]:
    return list(_exemplar_rows(filename))


GSM8K = PromptFormat(
    name="gsm8k",
    question_template="Question: {question}\nAnswer:",
    num_fewshot=5,
    stop=("Question:", "</s>", "<|im_end|>"),
    strict_pattern=extract.STRICT_GSM8K,
    fewshot_sampler="seeded_random",
    reference="solution",
)

GSM8K_COT = PromptFormat(
    name="gsm8k_cot",
    question_template="Q: {question}\nA:",
    num_fewshot=8,
    stop=("Q:", "</s>", "<|im_end|>"),
    strict_pattern=extract.STRICT_COT,
    fewshot_sampler="first_n",
    reference="final_answer",
    exemplars_file=COT_EXEMPLARS_FILE,
)

FORMATS: dict[str, PromptFormat] = {fmt.name: fmt for fmt in (GSM8K, GSM8K_COT)}


def get_format(name: str) -> PromptFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise MoebenchError(f"unknown prompt format {name!r}; known: {', '.join(FORMATS)}") from None
