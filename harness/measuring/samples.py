"""One line of a run's samples.jsonl, from a completion and its suite item."""

from __future__ import annotations


def trial_key(record: dict) -> tuple:
    """What one trial is, in samples.jsonl and trials.jsonl: a config's trial number at one offered
    load (None: the closed loop of a run without loads)."""
    return record["config"], int(record["trial"]), record.get("load")


def sample_record(cfg_name, trial, item, suite, completion) -> dict:
    """One line of samples.jsonl; a failed request (HTTP engines) is kept, with its error."""
    if completion.error is not None:
        return {"config": cfg_name, "trial": trial, "item_id": item.id, "prompt_tokens": None, "output": "",
                "answer": None, "answer_strict": None, "target": item.target, "correct": False,
                "correct_strict": False, "output_tokens": 0, "finish_reason": "error", "ttft_s": None,
                "latency_s": None, "tpot_s": None, "itl_s": [], "error": completion.error}
    score = suite.score(completion.text, item)
    itl = completion.itl_s
    n = completion.output_tokens
    return {
        "config": cfg_name,
        "trial": trial,
        "item_id": item.id,
        "prompt_tokens": completion.prompt_tokens,
        "output": completion.text,
        "answer": score.answer,
        "answer_strict": score.answer_strict,
        "target": item.target,
        "correct": bool(score.correct),
        "correct_strict": bool(score.correct_strict),
        "output_tokens": n,
        "finish_reason": completion.finish_reason,
        "ttft_s": round(completion.ttft_s, 6),
        "latency_s": round(completion.latency_s, 6),
        # vLLM's TPOT: the time after the first token over the tokens after it
        "tpot_s": round((completion.latency_s - completion.ttft_s) / (n - 1), 6) if n > 1 else None,
        "itl_s": [round(x, 6) for x in itl],
        "error": None,
    }
