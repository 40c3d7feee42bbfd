"""GSM8K suite: loading, bad input, prompts (checked against lm-eval's own tasks)."""

import hashlib
import json
import sys
import types
from pathlib import Path

import pytest

from moebench.errors import MoebenchError
from moebench.suites import Item, load_suite
from moebench.suites.prompts import GSM8K, GSM8K_COT

ROW = {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "test.jsonl", [ROW] * 3)
    write_jsonl(tmp_path / "train.jsonl", [ROW] * 6)
    return tmp_path


# --- loading ---------------------------------------------------------------------


def test_loads_full_offline_test_split(gsm8k_dir):
    suite = load_suite("gsm8k", data=gsm8k_dir)
    assert len(suite.items) == 1319
    assert [item.id for item in suite.items[:3]] == ["gsm8k/test/0", "gsm8k/test/1", "gsm8k/test/2"]
    assert suite.items[-1].id == "gsm8k/test/1318"
    first = suite.items[0]
    assert first.question.startswith("Janet")
    assert first.answer.endswith("#### 18")
    assert first.target == "18"
    assert suite.source == str(gsm8k_dir)
    assert len(suite.fewshot) == 7473


def test_targets_drop_thousands_separators(gsm8k_dir):
    suite = load_suite("gsm8k", data=gsm8k_dir, num_fewshot=0)
    with_comma = [item for item in suite.items if "," in item.answer.split("####")[-1]]
    assert with_comma
    assert all("," not in item.target and item.target.lstrip("-").isdigit() for item in with_comma)


def test_limit_takes_the_first_items(gsm8k_dir):
    full = load_suite("gsm8k", data=gsm8k_dir)
    part = load_suite("gsm8k", data=gsm8k_dir, limit=7)
    assert part.items == full.items[:7]
    # Few-shot draws depend only on an item's position, so a prefix keeps its prompts.
    assert [part.prompt(item) for item in part.items] == [full.prompt(item) for item in full.items[:7]]


def test_train_split_and_env_variable(gsm8k_dir, monkeypatch):
    monkeypatch.setenv("MOEBENCH_GSM8K_DIR", str(gsm8k_dir))
    suite = load_suite("gsm8k", split="train", limit=4)
    assert suite.source == str(gsm8k_dir)
    assert [item.id for item in suite.items] == [f"gsm8k/train/{i}" for i in range(4)]
    for item in suite.items:  # the asked item is never among its own shots
        assert all(shot.question != item.question for shot in suite.shots(item))


def test_describe_for_the_manifest(gsm8k_dir):
    suite = load_suite("gsm8k", data=gsm8k_dir, limit=5)
    ids = "\n".join(f"gsm8k/test/{i}" for i in range(5))
    assert suite.describe() == {
        "name": "gsm8k",
        "source": str(gsm8k_dir),
        "split": "test",
        "prompt_format": "gsm8k",
        "num_fewshot": 5,
        "num_items": 5,
        "item_ids_sha256": hashlib.sha256(ids.encode()).hexdigest(),
    }


def test_zero_shot_needs_no_train_file(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", [ROW])
    suite = load_suite("gsm8k", data=tmp_path, num_fewshot=0)
    assert suite.prompt(suite.items[0]) == "Question: What is 2 + 3?\nAnswer:"
    assert suite.fewshot == []


# --- bad input: one MoebenchError naming the file ---------------------------------


def error_of(**kwargs) -> str:
    with pytest.raises(MoebenchError) as caught:
        load_suite(kwargs.pop("name", "gsm8k"), **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_missing_directory(tmp_path):
    assert str(tmp_path / "nope") in error_of(data=tmp_path / "nope")


def test_missing_test_file(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [ROW])
    assert str(tmp_path / "test.jsonl") in error_of(data=tmp_path)


def test_missing_train_file_when_shots_are_asked(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", [ROW])
    assert str(tmp_path / "train.jsonl") in error_of(data=tmp_path)


def test_malformed_json_line_names_file_and_line(tiny_dir):
    path = tiny_dir / "test.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + '{"question": "x", \n')
    assert f"{path}:2" in error_of(data=tiny_dir)


@pytest.mark.parametrize("missing", ["question", "answer"])
def test_row_missing_a_field(tiny_dir, missing):
    row = {key: value for key, value in ROW.items() if key != missing}
    write_jsonl(tiny_dir / "test.jsonl", [ROW, row])
    message = error_of(data=tiny_dir)
    assert f"{tiny_dir / 'test.jsonl'}:2" in message and missing in message


@pytest.mark.parametrize("row", [["a list"], {"question": "q", "answer": "no final answer"}])
def test_row_of_the_wrong_shape(tiny_dir, row):
    write_jsonl(tiny_dir / "test.jsonl", [row])
    assert f"{tiny_dir / 'test.jsonl'}:1" in error_of(data=tiny_dir)


def test_empty_test_file(tiny_dir):
    (tiny_dir / "test.jsonl").write_text("\n")
    assert str(tiny_dir / "test.jsonl") in error_of(data=tiny_dir)


def test_bad_options(tiny_dir):
    assert "gsm-synth" in error_of(name="gsm9k", data=tiny_dir)
    assert "validation" in error_of(data=tiny_dir, split="validation")
    assert "limit" in error_of(data=tiny_dir, limit=0)
    assert "num_fewshot" in error_of(data=tiny_dir, num_fewshot=-1)
    assert "pool has 6" in error_of(data=tiny_dir, num_fewshot=7)
    assert "pool has 8" in error_of(name="gsm8k_cot", data=tiny_dir, num_fewshot=9)


# --- prompts ------------------------------------------------------------------------


def test_gsm8k_prompt_shape(gsm8k_dir):
    suite = load_suite("gsm8k", data=gsm8k_dir, limit=3)
    train_questions = {shot.question for shot in suite.fewshot}
    for item in suite.items:
        shots = suite.shots(item)
        assert len(shots) == 5 and all(shot.question in train_questions for shot in shots)
        prompt = suite.prompt(item)
        assert prompt.count("Question: ") == 6
        assert prompt.endswith("\n\nQuestion: " + item.question + "\nAnswer:")
        assert prompt.startswith(f"Question: {shots[0].question}\nAnswer: {shots[0].answer}\n\n")
    # Each item gets its own draw.
    assert suite.shots(suite.items[0]) != suite.shots(suite.items[1])
    assert suite.stop == ["Question:", "</s>", "<|im_end|>"]


def test_gsm8k_cot_prompt_shape(gsm8k_dir):
    suite = load_suite("gsm8k_cot", data=gsm8k_dir, limit=2)
    item = suite.items[0]
    prompt = suite.prompt(item)
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert prompt.count("The answer is") == 8
    assert prompt.endswith("The answer is 8.\n\nQ: " + item.question + "\nA:")
    assert suite.stop == ["Q:", "</s>", "<|im_end|>"]
    three = load_suite("gsm8k_cot", data=gsm8k_dir, limit=2, num_fewshot=3)
    assert three.prompt(item).count("The answer is") == 3
    assert three.describe()["num_fewshot"] == 3


def test_registry_builds_gsm_synth_lazily(monkeypatch):
    train = [Item(f"synth/train/{i}", f"q{i}", f"a\n#### {i}", str(i)) for i in range(4)]
    test = [Item(f"synth/test/{i}", f"t{i}", f"a\n#### {i}", str(i)) for i in range(3)]
    fake = types.ModuleType("moebench.suites.synth")
    fake.load_synth_items = lambda split, limit: (test[:limit], train)
    monkeypatch.setitem(sys.modules, "moebench.suites.synth", fake)
    suite = load_suite("gsm-synth", limit=2)
    assert suite.prompt_format is GSM8K and suite.num_fewshot == 0
    assert suite.prompt(suite.items[0]) == "Question: t0\nAnswer:"
    assert load_suite("gsm-synth", num_fewshot=2).prompt(test[0]).count("Question:") == 3


# --- lm-eval parity -----------------------------------------------------------------


def test_cot_exemplars_match_lmeval_yaml():
    yaml = pytest.importorskip("yaml")
    lm_eval = pytest.importorskip("lm_eval")
    task_yaml = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot.yaml"
    samples = yaml.safe_load(task_yaml.read_text())["fewshot_config"]["samples"]
    exemplars = GSM8K_COT.exemplars()
    assert [(e.question, e.answer) for e in exemplars] == [(s["question"], s["target"]) for s in samples]
    assert all(e.answer.endswith(f"The answer is {e.target}.") for e in exemplars)


def test_prompts_equal_lmeval_contexts(gsm8k_dir, tmp_path, monkeypatch):
    """lm-eval's gsm8k and gsm8k_cot tasks, pointed at the same files, build the same prompts."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task_dir = Path(lm_eval.__file__).parent / "tasks" / "gsm8k"
    for task, yaml_name in [("gsm8k", "gsm8k.yaml"), ("gsm8k_cot", "gsm8k-cot.yaml")]:
        (tmp_path / f"{task}_local.yaml").write_text(
            f"include: {task_dir / yaml_name}\n"
            f"task: {task}_moebench_test\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            "dataset_kwargs:\n"
            "  data_files:\n"
            f"    train: {gsm8k_dir / 'train.jsonl'}\n"
            f"    test: {gsm8k_dir / 'test.jsonl'}\n"
        )
    # Only our two YAML files are indexed (they include the installed ones by path).
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    tasks = manager.load(["gsm8k_moebench_test", "gsm8k_cot_moebench_test"])["tasks"]
    count = 4
    for name, format_ in [("gsm8k", GSM8K), ("gsm8k_cot", GSM8K_COT)]:
        task = tasks[f"{name}_moebench_test"]
        task.set_fewshot_seed(1234)  # lm-eval's default --seed for few-shot sampling
        docs = list(task.eval_docs)[:count]
        expected = [task.fewshot_context(doc, num_fewshot=task.config.num_fewshot) for doc in docs]
        suite = load_suite(name, data=gsm8k_dir, limit=count)
        assert suite.num_fewshot == task.config.num_fewshot
        assert suite.stop == task.config.generation_kwargs["until"]
        assert [suite.prompt(item) for item in suite.items] == expected
        assert [format_.reference_for(item) for item in suite.items] == [task.doc_to_target(d) for d in docs]
