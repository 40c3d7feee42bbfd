"""GSM8K items from a local directory (test.jsonl, train.jsonl) or the Hugging Face hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moebench.errors import MoebenchError
from moebench.suites.base import Item, Suite
from moebench.suites.prompts import PromptFormat

HUB_DATASET = "openai/gsm8k"
HUB_CONFIG = "main"
DATA_DIR_ENV = "MOEBENCH_GSM8K_DIR"
SPLITS = ("test", "train")
# The split lm-eval's gsm8k task draws its few-shot examples from.
FEWSHOT_SPLIT = "train"


def data_dir(data: Path | str | None) -> Path | None:
    """The local data directory to read: `data`, else $MOEBENCH_GSM8K_DIR, else None (hub)."""
    if data is not None:
        return Path(data)
    from_env = os.environ.get(DATA_DIR_ENV)
    return Path(from_env) if from_env else None


def final_answer(solution: str) -> str:
    """The number after the last "####", without thousands separators or "$"."""
    return solution.split("####")[-1].strip().replace(",", "").replace("$", "")


def item_from_row(row: object, split: str, index: int, where: str) -> Item:
    if not isinstance(row, dict):
        raise MoebenchError(f"{where}: expected a JSON object with 'question' and 'answer'")
    for field in ("question", "answer"):
        if not isinstance(row.get(field), str):
            raise MoebenchError(f"{where}: row has no {field!r} text")
    if "####" not in row["answer"] or not final_answer(row["answer"]):
        raise MoebenchError(f"{where}: answer has no final answer after '####'")
    return Item(
        id=f"gsm8k/{split}/{index}",
        question=row["question"],
        answer=row["answer"],
        target=final_answer(row["answer"]),
    )


def read_split_file(path: Path, split: str, limit: int | None) -> list[Item]:
    """Items of one JSONL file; blank lines are skipped, ids count rows."""
    if not path.is_file():
        raise MoebenchError(f"{path}: file not found (a GSM8K directory holds test.jsonl and train.jsonl)")
    items: list[Item] = []
    try:
        with path.open(encoding="utf-8") as lines:
            for line_no, line in enumerate(lines, start=1):
                if limit is not None and len(items) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise MoebenchError(f"{where}: malformed JSON ({err.msg})") from None
                items.append(item_from_row(row, split, len(items), where))
    except UnicodeDecodeError as err:
        raise MoebenchError(f"{path}: not UTF-8 text ({err.reason})") from None
    if not items:
        raise MoebenchError(f"{path}: no items")
    return items


def read_hub_split(split: str, limit: int | None) -> list[Item]:
    try:
        import datasets

        rows = datasets.load_dataset(HUB_DATASET, HUB_CONFIG, split=split)
    except Exception as err:  # network, cache and hub errors all mean the same to a user
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MoebenchError(
            f"{HUB_DATASET}: cannot load split {split!r} from the Hugging Face hub ({reason}); "
            f"pass a local directory (--data or ${DATA_DIR_ENV})"
        ) from None
    count = len(rows) if limit is None else min(limit, len(rows))
    items = [item_from_row(rows[i], split, i, f"{HUB_DATASET}[{split}][{i}]") for i in range(count)]
    if not items:
        raise MoebenchError(f"{HUB_DATASET}: split {split!r} has no items")
    return items


def load_split(split: str, data: Path | str | None, limit: int | None) -> tuple[list[Item], str]:
    """(items, source): source is the resolved directory or the hub id."""
    if split not in SPLITS:
        raise MoebenchError(f"gsm8k: unknown split {split!r}; known: {', '.join(SPLITS)}")
    directory = data_dir(data)
    if directory is None:
        return read_hub_split(split, limit), HUB_DATASET
    if not directory.is_dir():
        raise MoebenchError(f"{directory}: GSM8K data directory not found")
    return read_split_file(directory / f"{split}.jsonl", split, limit), str(directory.resolve())


def build_gsm8k_suite(
    name: str,
    prompt_format: PromptFormat,
    *,
    data: Path | str | None = None,
    limit: int | None = None,
    split: str = "test",
    num_fewshot: int | None = None,
) -> Suite:
    if limit is not None and limit < 1:
        raise MoebenchError(f"{name}: limit must be at least 1, got {limit}")
    items, source = load_split(split, data, limit)
    shots = prompt_format.num_fewshot if num_fewshot is None else num_fewshot
    pool_split: str | None = None
    if prompt_format.exemplars_file:
        pool = prompt_format.exemplars()
    else:
        pool_split = FEWSHOT_SPLIT
        # Reading train.jsonl is skipped when no shots are asked for, so a zero-shot run
        # needs only test.jsonl.
        pool = load_split(FEWSHOT_SPLIT, data, None)[0] if shots > 0 else []
    return Suite(
        name=name,
        source=source,
        split=split,
        items=items,
        prompt_format=prompt_format,
        fewshot=pool,
        num_fewshot=shots,
        fewshot_split=pool_split,
    )
