"""Continuous batching in llama-server, proved by what the server did: a prompt started while
another slot was already generating. Recorded from real servers (llama.cpp 0.5.0-dev, 16 slots,
24 concurrent requests): with --cont-batching prompts join running slots; with --no-cont-batching
the slot count, n_seq_max and /props total_slots are the same (they echo --parallel 16) and no
prompt ever joins, so the configuration's evidence refuses that server."""

from __future__ import annotations

from moebench.backends.evidence import evaluate
from moebench.backends.log_readers import llamacpp_prompts_joining_decoding
from moebench.backends.profiles import load_profiles
from moebench.backends.recorded import load_observation, read_log
from moebench.cli.profiles import check_profile
from repo_paths import FIXTURES, REPO

LOGS = FIXTURES / "engine_logs" / "llamacpp-0.3.36"
PROFILE = REPO / "profiles" / "llamacpp-cpu.toml"


def _cont_batching():
    return next(p for p in load_profiles(PROFILE).profiles if p.name == "cont-batching")


def test_prompts_join_running_slots_only_with_continuous_batching():
    on = read_log(LOGS / "cont-batching.log")
    off = read_log(LOGS / "cont-batching.no-cont-batching.log")
    assert "--parallel 16 --cont-batching" in on and "--parallel 16 --no-cont-batching" in off
    assert llamacpp_prompts_joining_decoding(on) >= 1
    assert llamacpp_prompts_joining_decoding(off) == 0
    # one slot: no task is ever launched beside a running one, so nothing could show either way
    assert llamacpp_prompts_joining_decoding(read_log(LOGS / "baseline.log")) is None


def test_the_server_without_continuous_batching_is_refused_and_the_one_with_it_passes():
    profile = _cont_batching()
    off = load_observation(LOGS, "cont-batching.no-cont-batching")
    errors = evaluate(profile.evidence, "start", off)[1] + evaluate(profile.evidence, "end", off)[1]
    assert errors and all("llamacpp_prompts_joining_decoding at_least 1: read 0" in e for e in errors)
    on = load_observation(LOGS, "cont-batching")
    assert evaluate(profile.evidence, "start", on)[1] + evaluate(profile.evidence, "end", on)[1] == []
    lines = []
    assert check_profile(PROFILE, echo=lines.append) == []
    assert any(line.startswith("  refuses cont-batching.no-cont-batching.log (output that must not prove it): log "
                               "reader llamacpp_prompts_joining_decoding at_least 1: read 0") for line in lines)


def test_the_slot_count_alone_accepts_the_server_without_it(tmp_path):
    """The old evidence (n_slots = 16, n_seq_max = 16, total_slots = 16) holds for the server with
    --no-cont-batching: profiles check fails it on that recording, and as echo alone."""
    text = PROFILE.read_text()
    reader = '''[[profile.evidence.log_value]]
reader = "llamacpp_prompts_joining_decoding"
at_least = 1
kind = "runtime"
[[profile.evidence.endpoint]]
path = "/props"
field = "total_slots"
equals = 16
when = "start"

[[profile]]
name = "flash-attn"'''
    assert text.count(reader) == 1
    path = tmp_path / "slots-only.toml"
    path.write_text(text.replace(reader, reader.split("\n", 4)[4]).replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    problems = check_profile(path, echo=lambda _: None)
    assert f"{path}: profile 'cont-batching': 'cont-batching' is proved only by the server repeating its arguments" \
           in problems[0]
    assert any(p.endswith("cont-batching.no-cont-batching.log, output recorded as not proving it") for p in problems)


def test_prompts_that_start_together_do_not_count():
    """A static batch: every task launched before any prompt ran, all prompts in one pass."""
    lines = []
    for slot in (0, 1):
        lines.append(f"0.00.1 I slot launch_slot_: id {slot:2d} | task {slot} | processing task, is_child = 0")
    for slot in (0, 1):
        lines.append(f"0.00.2 I slot   operator(): id {slot:2d} | task {slot} | new prompt, n_ctx_slot = 1024, n_keep = 0")
        lines.append(f"0.00.2 I slot init_sampler: id {slot:2d} | task {slot} | init sampler, took 0.01 ms")
    # the next task lands in slot 0 once its first task stopped: a new sequence, not a join
    lines += ["0.00.3 I slot      release: id  0 | task 0 | stop processing: n_tokens = 9, truncated = 0",
              "0.00.3 I slot launch_slot_: id  0 | task 2 | processing task, is_child = 0",
              "0.00.4 I slot      release: id  1 | task 1 | stop processing: n_tokens = 9, truncated = 0",
              "0.00.4 I slot   operator(): id  0 | task 2 | new prompt, n_ctx_slot = 1024, n_keep = 0"]
    assert llamacpp_prompts_joining_decoding("\n".join(lines)) == 0
    # the same, with task 2's prompt started while task 1 still ran: continuous batching
    joined = lines[:-2] + [lines[-1], lines[-2]]
    assert llamacpp_prompts_joining_decoding("\n".join(joined)) == 1


def test_a_warm_up_that_did_not_exercise_it_leaves_flash_attention_echo_only():
    """At warm-up cont-batching's own server may have had no chance to show a join (its requests
    started together): its reader then reads "not exercised", which never holds. stack's reader
    item would then also fail wherever flash attention is off and seem to prove it; the profile's
    proves = "cont-batching" keeps it to continuous batching, so stack stays echo-only for flash
    attention, as marked."""
    from moebench.backends.discrimination import judge

    pf = load_profiles(PROFILE)
    observations = {p.name: load_observation(LOGS, p.name) for p in pf.profiles}
    observations["cont-batching"].log = read_log(LOGS / "baseline.log")  # no task ever beside a running one
    stack = next(p for p in pf.profiles if p.name == "stack")
    verdict = judge(stack, observations, pf.profiles, "baseline")
    assert verdict.ok, verdict.problem()
    assert verdict.echo_proved == ["flash-attn"]
    assert [i.kind for i in verdict.proofs["cont-batching"]].count("runtime") == 1


def test_profiles_check_exits_2_on_the_recorded_server_without_it(tmp_path):
    """The real --no-cont-batching recording as cont-batching's own output: exit 2, one line."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "recorded"
    shutil.copytree(LOGS, folder)
    for suffix in (".log", ".endpoints.json"):
        shutil.copy(folder / f"cont-batching.no-cont-batching{suffix}", folder / f"cont-batching{suffix}")
    result = subprocess.run([sys.executable, "-m", "moebench", "profiles", "check", str(PROFILE), "--recorded",
                             str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"moebench: error: {PROFILE}: profile 'cont-batching': its evidence fails on its "
                                    f"own recorded output ({folder / 'cont-batching.log'}")
    assert "log reader llamacpp_prompts_joining_decoding at_least 1: read 0" in result.stderr
