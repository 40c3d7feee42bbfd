"""`moebench lm-eval`: lm-eval's own evaluation (`lm_eval.simple_evaluate`) with the bundled
runtime as its model (`moebench.measuring.lm_eval_model`, registered for lm-eval as `moebench`).

Task names: `gsm-synth` (the bundled model's suite, as an lm-eval task), `gsm8k` (lm-eval's gsm8k
task; from local files when --data or $MOEBENCH_GSM8K_DIR names a GSM8K directory, else from the
hub), or any task lm-eval knows.
"""

import json
from pathlib import Path
from typing import Optional

import typer

from moebench.errors import MoebenchError
from moebench.cli.options import BATCH_SIZE, DEVICE, EXPERT_BUDGET, KERNEL, PREFETCH, SCHEDULER, THREADS, cpu_threads


def lm_eval_command(
    tasks: str = typer.Option(..., "--tasks", help="Comma-separated tasks: gsm-synth, gsm8k, or any lm-eval task name."),
    limit: Optional[int] = typer.Option(None, "--limit", help="The first N items of each task (from --offset)."),
    offset: int = typer.Option(0, "--offset", help="Skip the first N items of each task (with --limit: items N to N+limit-1; lm-eval's own --samples selection, so few-shot draws follow the items asked)."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples per prompt (default: the task's; the bundled model's 512-token context needs 0 for gsm8k)."),
    data: Optional[Path] = typer.Option(None, "--data", help="GSM8K directory with train.jsonl and test.jsonl (else $MOEBENCH_GSM8K_DIR, else the hub)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory. Default: the bundled gsm-synth MoE."),
    kernel: str = KERNEL,
    scheduler: str = SCHEDULER,
    prefetch: str = PREFETCH,
    batch_size: int = BATCH_SIZE,
    max_gen_toks: int = typer.Option(256, "--max-gen-toks", help="Generation limit when a task gives none."),
    expert_budget: Optional[str] = EXPERT_BUDGET,
    device: str = DEVICE,
    threads: Optional[int] = THREADS,
    output: Optional[Path] = typer.Option(None, "--output", help="Write lm-eval's results (and per-item samples) here as JSON."),
):
    """Run lm-eval's tasks with the bundled runtime as the model (lm_eval.simple_evaluate)."""
    import tempfile

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise MoebenchError("--tasks: give at least one task")
    if limit is not None and limit < 1:
        raise MoebenchError(f"--limit must be >= 1, got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise MoebenchError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if offset < 0:
        raise MoebenchError(f"--offset must be >= 0, got {offset}")

    import lm_eval
    from lm_eval.tasks import TaskManager

    from moebench.measuring.lm_eval_model import MoebenchLM, gsm8k_data_dir, render_tasks

    gsm8k_dir = gsm8k_data_dir(data)
    with tempfile.TemporaryDirectory(prefix="moebench-lm-eval-") as tmp:
        ours = render_tasks(Path(tmp), gsm8k_dir)
        rename = {"gsm-synth": "gsm_synth", "gsm8k": "gsm8k_local" if gsm8k_dir is not None else "gsm8k"}
        task_names = [rename.get(n, n) for n in names]
        # lm-eval's own index of thousands of task files takes half a minute: only when asked for
        manager = TaskManager(include_path=tmp, include_defaults=not set(task_names) <= set(ours))
        unknown = [n for n in task_names if n not in manager.all_tasks]
        if unknown:
            raise MoebenchError(f"--tasks: unknown to lm-eval: {', '.join(unknown)}")
        lm = MoebenchLM(model=str(model) if model else None, kernel=kernel, scheduler=scheduler, prefetch=prefetch,
                        batch_size=batch_size, max_gen_toks=max_gen_toks, expert_budget=expert_budget or "1.0",
                        device=device, threads=cpu_threads(threads, device))
        try:
            selection = _selection(task_names, manager, offset, limit) if offset else None
            _quiet_git_lookup()
            results = lm_eval.simple_evaluate(model=lm, tasks=task_names, num_fewshot=num_fewshot,
                                              limit=None if selection else limit, samples=selection,
                                              task_manager=manager, log_samples=output is not None)
        finally:
            lm.close()
    if results is None:
        raise MoebenchError("lm-eval returned no results")
    for task, metrics in results["results"].items():
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and "_stderr" not in k}
        typer.echo(f"{task}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in shown.items()))
    if lm.activation_errors:
        raise MoebenchError("activation failed: " + "; ".join(lm.activation_errors))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        keep = {"results": results["results"], "configs": results.get("configs"), "n-shot": results.get("n-shot"),
                "samples": results.get("samples"), "moebench": {"switches": lm.runtime.switches(),
                                                               "evidence": lm.evidence}}
        output.write_text(json.dumps(keep, indent=1, default=str))
        typer.echo(f"results: {output}")


def _selection(task_names: list[str], manager, offset: int, limit: int | None) -> dict[str, list[int]]:
    """Item indices per task from `offset` on, as lm-eval's `samples` argument takes them."""
    from lm_eval.tasks import get_task_dict

    tasks = get_task_dict(task_names, manager)
    selection = {}
    for name in task_names:
        task = tasks.get(name)
        if task is None or not hasattr(task, "eval_docs"):
            raise MoebenchError(f"--offset: '{name}' is a group of tasks; give its tasks by name")
        size = len(task.eval_docs)
        if offset >= size:
            raise MoebenchError(f"--offset {offset}: task '{name}' has {size} items")
        selection[name] = list(range(offset, size if limit is None else min(size, offset + limit)))
    return selection


def _quiet_git_lookup() -> None:
    """lm-eval records the git commit of the working directory by running `git describe` with git's
    stderr left on ours: outside a repository every evaluation printed `fatal: not a git
    repository`. The same lookup, with git's complaint kept to itself."""
    import subprocess

    import lm_eval.evaluator

    def git_commit() -> str | None:
        try:
            done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() or None if done.returncode == 0 else None

    lm_eval.evaluator.get_git_commit_hash = git_commit
