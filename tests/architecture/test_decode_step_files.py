"""A decode step on the native path does per-step work only: what a session fixes once (the
extension and its thread pool, the bytes a step reads per token, a request's greediness) is not
looked up again each step. The real engine on the bundled model, every Python call of one decode
step recorded (benchmarks/step_files.py lists them; docs/architecture.md names the files)."""

import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.sampling import SamplingParams
from moebench.engine.sequence import Sequence

# the files a native decode step runs Python code in (docs/architecture.md, "One decode step")
STEP_FILES = {"engine/llm_engine.py", "engine/scheduler.py", "engine/sequence.py", "engine/kv_cache.py",
              "engine/runner.py", "engine/moe.py", "engine/sampling.py", "engine/store/resident.py"}


# the files a decode step of the default ablation's baseline runs Python code in: the chained path with
# the naive kernel's per-expert loop (kernels/reference.py) over an offloaded store (store/native.py)
BASELINE_FILES = {"engine/llm_engine.py", "engine/scheduler.py", "engine/sequence.py", "engine/kv_cache.py",
                  "engine/runner.py", "engine/model.py", "engine/moe.py", "engine/sampling.py",
                  "engine/store/native.py", "kernels/reference.py"}


def one_decode_step_calls(monkeypatch, kernel="fused", decode_path="native", budget=1.0):
    from moebench.kernels import cpu_moe
    from moebench.measuring.run import bundled_model_path

    if cpu_moe.load_extension() is None:
        pytest.skip("the C++ extension did not build here: no native decode path")
    ckpt = load_checkpoint(bundled_model_path(), dtype=torch.float32, experts_in_checkpoint_dtype=True)
    rt = RuntimeConfig(kernel=kernel, decode_path=decode_path, expert_budget=budget, batch_size=4,
                       max_new_tokens=16, offload_tier="host")
    session = Engine(ckpt, None, rt).session(64)
    for i in range(4):
        session.add(Sequence(Request(f"r{i}", "", 16), [5 + i, 6, 7], 16, time.perf_counter()))
    for _ in range(3):  # the prefill and two decode steps: what is built on first use is built
        session.step()
    lookups = []
    monkeypatch.setattr(cpu_moe, "load_extension", lambda: lookups.append(1) or cpu_moe._extension.get())
    package = Path(cpu_moe.__file__).resolve().parents[1]
    calls: dict[str, list[str]] = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(package)):
            name = str(Path(frame.f_code.co_filename).resolve().relative_to(package))
            calls.setdefault(name, []).append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        record = session.step()
    finally:
        sys.setprofile(None)
    session.close()
    assert record.phase == "decode" and session.evidence()["decode_path"]["path"] == decode_path
    return calls, lookups


def test_a_native_decode_step_looks_nothing_up_and_stays_in_its_files(monkeypatch):
    calls, lookups = one_decode_step_calls(monkeypatch)
    assert lookups == []  # the extension was looked up once per session, not in the step
    assert "kernels/build.py" not in calls and "kernels/cpu_moe.py" not in calls
    assert "engine/config.py" not in calls and "engine/families.py" not in calls  # per-session constants
    assert calls["engine/sampling.py"] == ["choose_tokens", "<genexpr>", "<genexpr>", "<genexpr>", "<genexpr>",
                                           "<genexpr>", "greedy_token_ids"]  # greediness fixed with the params
    assert set(calls) <= STEP_FILES, sorted(set(calls) - STEP_FILES)
    assert calls["engine/moe.py"].count("record") == 0  # every layer recorded in one call


def test_greediness_is_fixed_with_the_params_and_leaves_equality_alone():
    sampled, greedy = SamplingParams(0.7, seed=3), SamplingParams()
    assert greedy.greedy and not sampled.greedy
    assert replace(sampled, temperature=0.0).greedy and not replace(greedy, temperature=1.0).greedy
    assert pickle.loads(pickle.dumps(sampled)) == sampled and not pickle.loads(pickle.dumps(sampled)).greedy
    assert SamplingParams(0.7, seed=3) == sampled and hash(SamplingParams(0.7, seed=3)) == hash(sampled)
    assert "greedy" not in repr(sampled)


def test_the_default_ablations_baseline_step_stays_in_its_files(monkeypatch):
    """The baseline step runs its layer loop in Python, with nothing looked up per call: the ops it
    runs were bound when the session's runner was made."""
    calls, lookups = one_decode_step_calls(monkeypatch, kernel="naive", decode_path="chained", budget=0.5)
    assert lookups == []
    assert set(calls) <= BASELINE_FILES, sorted(set(calls) - BASELINE_FILES)
    assert "engine/store/expert_store.py" not in calls  # prefetch=off has no hooks to call
