"""What every benchmark suite is: items, a prompt format, few-shot examples, scoring."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moebench.errors import MoebenchError
from moebench.suites import extract

if TYPE_CHECKING:
    from moebench.suites.prompts import PromptFormat


@dataclass(frozen=True)
class Item:
    id: str  # stable across runs, e.g. "gsm8k/test/17" (row index in the split)
    question: str
    answer: str  # the full reference solution
    target: str  # the final answer after "####", with "," and "$" removed


@dataclass(frozen=True)
class Score:
    answer: str | None  # flexible-extract answer; None when the output holds no number
    answer_strict: str | None  # strict-match answer; None when the pattern did not match
    correct: bool  # flexible-extract exact match: the accuracy lm-eval's gsm8k reports
    correct_strict: bool


class Suite:
    """A list of items with the prompt format and few-shot pool used to ask them.

    Few-shot examples are chosen per item the way lm-eval chooses them, which depends on
    an item's position in `items`; prompts are therefore only defined for these items.
    """

    def __init__(
        self,
        *,
        name: str,
        source: str,
        split: str,
        items: list[Item],
        prompt_format: PromptFormat,
        fewshot: list[Item] | None = None,
        num_fewshot: int | None = None,
        fewshot_split: str | None = None,
    ) -> None:
        self.name = name
        self.source = source
        self.split = split
        self.items = list(items)
        self.prompt_format = prompt_format
        self.fewshot = list(fewshot or [])
        self.num_fewshot = prompt_format.num_fewshot if num_fewshot is None else num_fewshot
        # lm-eval leaves the asked item out of its few-shot draw only when the few-shot
        # pool is the evaluated split itself.
        self._exclude_self = fewshot_split is not None and fewshot_split == split
        self._check()
        self._shots: dict[str, list[Item]] | None = None

    def _check(self) -> None:
        if not self.items:
            raise MoebenchError(f"{self.source}: suite {self.name!r} has no items in split {self.split!r}")
        ids = [item.id for item in self.items]
        if len(set(ids)) != len(ids):
            raise MoebenchError(f"{self.source}: suite {self.name!r} has duplicate item ids")
        if self.num_fewshot < 0:
            raise MoebenchError(f"{self.name}: num_fewshot must be >= 0, got {self.num_fewshot}")
        needed = self.num_fewshot + (1 if self._exclude_self and self.num_fewshot else 0)
        if needed > len(self.fewshot):
            raise MoebenchError(
                f"{self.source}: suite {self.name!r} asks for {self.num_fewshot} few-shot "
                f"examples but its pool has {len(self.fewshot)}"
            )

    def shots(self, item: Item) -> list[Item]:
        """The few-shot examples shown before `item`."""
        if self._shots is None:
            chosen = self.prompt_format.choose_fewshot(
                self.items, self.fewshot, self.num_fewshot, exclude_self=self._exclude_self
            )
            self._shots = {it.id: shots for it, shots in zip(self.items, chosen)}
        try:
            return self._shots[item.id]
        except KeyError:
            raise MoebenchError(f"{self.name}: item {item.id!r} is not in this suite") from None

    def prompt(self, item: Item) -> str:
        return self.prompt_format.render(item, self.shots(item))

    @property
    def stop(self) -> list[str]:
        return list(self.prompt_format.stop)

    def score(self, output: str, item: Item) -> Score:
        reference = self.prompt_format.reference_for(item)
        answer = extract.flexible_answer(output)
        answer_strict = extract.strict_answer(output, self.prompt_format.strict_pattern)
        return Score(
            answer=answer,
            answer_strict=answer_strict,
            correct=extract.exact_match(answer, reference),
            correct_strict=extract.exact_match(answer_strict, reference),
        )

    def item_ids_sha256(self) -> str:
        """Fingerprint of the item list: sha256 of the ids joined by newlines."""
        return hashlib.sha256("\n".join(item.id for item in self.items).encode()).hexdigest()

    def describe(self) -> dict:
        """The manifest's `suite` entry."""
        return {
            "name": self.name,
            "source": self.source,
            "split": self.split,
            "prompt_format": self.prompt_format.name,
            "num_fewshot": self.num_fewshot,
            "num_items": len(self.items),
            "item_ids_sha256": self.item_ids_sha256(),
        }
