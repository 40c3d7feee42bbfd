"""Activation on every run, however small: what a switch needs from the
workload is "not exercised", never "ok"; a fallback is a failure; an idle prefetcher is an error;
and a batch of one works with continuous batching. Real runs of the bundled model, a few items."""

import json

import pytest
import typer
from typer.testing import CliRunner

from moebench.errors import ActivationError, MoebenchError
from moebench.cli.run import run_command


def run(tmp_path, *args):
    """`moebench run` on the bundled model with a tiny workload -> (exit code, run dir, result)."""
    app = typer.Typer()
    app.command("run")(run_command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["run", "--max-new-tokens", "8", "--warmup", "2", "--out", str(tmp_path),
                                      "--run-id", "r", *map(str, args)])
    code = 2 if isinstance(result.exception, MoebenchError) else result.exit_code
    return code, tmp_path / "r", result


def trials(run_dir):
    return [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]


def test_a_small_ablation_checks_every_switch_and_rotates_the_order(tmp_path):
    code, run_dir, result = run(tmp_path, "--ablate", "--limit", 4, "--repeats", 2)
    assert code == 0, result.output
    rows = trials(run_dir)
    # the bundled default's ablation offloads (budget 0.5): the all-resident reference runs beside it
    names = ["baseline", "kernel", "scheduler", "prefetch", "kernel+scheduler", "all", "resident"]
    order = {t: [r["config"] for r in sorted((r for r in rows if r["trial"] == t), key=lambda r: r["position"])]
             for t in (0, 1)}
    assert order == {0: names, 1: names[1:] + names[:1]}  # trial 1 starts one place later
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["intervals"]["order"] == "rotated"
    status = {c["name"]: c["activation"]["status"] for c in summary["configs"]}
    # 4 requests, batch 16: continuous batching had nothing to admit mid-flight
    assert status == {"baseline": "ok", "kernel": "ok", "scheduler": "not exercised", "prefetch": "ok",
                      "kernel+scheduler": "not exercised", "all": "not exercised", "resident": "ok"}
    sched = next(c for c in summary["configs"] if c["name"] == "scheduler")["activation"]
    assert "4 requests fit one batch of 16" in sched["not_exercised"][0]
    # the kernel's evidence names the implementation that computed every call
    kernel = next(r for r in rows if r["config"] == "kernel")["evidence"]["kernel"]
    assert kernel["backends"] == {"cpp-avx2-pool": kernel["fused_calls"]}


def test_a_small_run_whose_fused_kernel_fell_back_fails(tmp_path, monkeypatch):
    """Before: with no more requests than the batch size every activation error was dropped, and the
    evidence was a call count, so a fused run computed by the torch fallback passed."""
    import moebench.kernels.cpu_moe as cpu_moe

    monkeypatch.setattr(cpu_moe, "load_extension", lambda: None)  # as if the C++ build had failed
    monkeypatch.delenv("MOEBENCH_ALLOW_FALLBACK", raising=False)
    monkeypatch.delenv("MOEBENCH_CPU_KERNEL", raising=False)
    code, _, result = run(tmp_path, "--kernel", "fused", "--limit", 3)
    assert code == 2 and isinstance(result.exception, ActivationError)
    assert "kernel=fused fell back to torch-grouped" in str(result.exception)
    monkeypatch.setenv("MOEBENCH_ALLOW_FALLBACK", "1")  # the user accepts it: then it is a result
    code, run_dir, result = run(tmp_path / "allowed", "--kernel", "fused", "--limit", 3)
    assert code == 0, result.output
    assert trials(run_dir)[0]["evidence"]["kernel"]["backends"] == {
        "torch-grouped": trials(run_dir)[0]["evidence"]["kernel"]["fused_calls"]}


def test_continuous_batching_with_a_batch_of_one(tmp_path):
    code, run_dir, result = run(tmp_path, "--scheduler", "continuous", "--batch-size", 1, "--limit", 3)
    assert code == 0, result.output
    (row,) = trials(run_dir)
    assert row["activation_ok"] is True and row["activation_errors"] == []
    assert "a batch of one" in row["not_exercised"][0]


def test_lookahead_with_every_expert_resident_is_an_error(tmp_path):
    code, _, result = run(tmp_path, "--prefetch", "lookahead", "--limit", 2)
    assert code == 2
    assert "nothing to prefetch" in str(result.exception) and "--expert-budget" in str(result.exception)
    code, _, result = run(tmp_path / "ok", "--prefetch", "lookahead", "--limit", 2, "--expert-budget", 0.5)
    assert code == 0, result.output


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_off_and_lookahead_get_the_same_store(tier):
    """prefetch=off has the loader threads, readers and pinning that lookahead has: the switch
    changes only when loads happen."""
    import torch

    from moebench.engine import RuntimeConfig, load_checkpoint
    from moebench.engine.store.factory import make_store_and_prefetcher
    from moebench.measuring.run import bundled_model_path

    ckpt = load_checkpoint(bundled_model_path(), dtype=torch.float32, experts_in_checkpoint_dtype=True)
    stores = {}
    for prefetch in ("off", "lookahead"):
        store, _ = make_store_and_prefetcher(ckpt, RuntimeConfig(prefetch=prefetch, expert_budget=0.5,
                                                                 offload_tier=tier))
        ev = store.evidence()
        stores[prefetch] = ({k: ev[k] for k in ("load_workers", "native_loader", "loader_cpus", "slots_per_layer",
                                                "expert_dtype", "rows")},
                            store.demand_executor is not None)
        store.close()
    assert stores["off"] == stores["lookahead"]
    assert stores["off"][0]["load_workers"] >= 1


def test_decode_attention_names_its_backend_and_a_fallback_fails(monkeypatch):
    import torch

    import moebench.engine.model as model_mod
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.overrides import Overrides
    from moebench.measuring.run import bundled_model_path

    ckpt = load_checkpoint(bundled_model_path(), dtype=torch.float32)

    def generate(overrides=Overrides()):
        rt = RuntimeConfig(batch_size=2, max_new_tokens=4, overrides=overrides)
        return Engine(ckpt, None, rt).generate([Request("a", ""), Request("b", "")], prompt_ids=[[5, 6, 7], [8, 9]])

    result = generate()
    backends = result.evidence["attention"]
    assert set(backends) <= {"cpp-block", "cpp-paged"} and sum(backends.values()) > 0
    assert result.activation_errors == []
    monkeypatch.setattr(model_mod, "cpu_step_ops", lambda: None)  # as if the C++ build had failed
    monkeypatch.setattr(model_mod, "paged_decode_attention", lambda *a, **k: None)
    result = generate()
    assert set(result.evidence["attention"]) == {"torch-sdpa"}
    assert any("decode attention fell back to torch SDPA" in e for e in result.activation_errors)
    assert generate(Overrides(attention="torch")).activation_errors == []  # chosen by the user: a result


def test_both_kernels_get_the_same_slots_for_a_byte_budget(tmp_path):
    """Both kernels get a bfloat16 checkpoint's experts in one dtype, so a budget in bytes buys both
    the same slots, counted in the bytes the store holds."""
    import torch

    from moebench.engine import RuntimeConfig, load_checkpoint
    from moebench.engine.store.factory import make_store_and_prefetcher
    from moebench.kernels import cpu_backend
    from moebench.kernels.cpu_moe import BACKEND_CPP
    from tiny_models import make_tiny_checkpoint

    if cpu_backend() != BACKEND_CPP:
        pytest.skip("bfloat16 experts are held only where the C++ kernels widen them")
    path = make_tiny_checkpoint(tmp_path, dtype=torch.bfloat16, num_experts=16, num_hidden_layers=2)
    ckpt = load_checkpoint(path, dtype=torch.float32, experts_in_checkpoint_dtype=True)
    eight_bfloat16_experts = 2 * 8 * ckpt.config.expert_param_count * 2  # 2 MoE layers
    budget = f"{eight_bfloat16_experts / 2**20!r}MiB"
    seen = {}
    for kernel in ("naive", "fused"):
        store, _ = make_store_and_prefetcher(ckpt, RuntimeConfig(kernel=kernel, expert_budget=budget))
        ev = store.evidence()
        seen[kernel] = (ev.get("slots_per_layer"), ev["expert_dtype"])
        store.close()
    assert seen["naive"] == seen["fused"] == (8, "bfloat16")
