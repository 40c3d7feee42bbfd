"""HTTP overhead of `moebench serve`: the same gsm-synth workload in-process (Engine.generate) and
through the server (the OpenAI client engine, moebench.backends.openai, streaming at a fixed
concurrency), rounds interleaved A B A B on one machine, outputs compared item by item.

    python benchmarks/bench_serve.py --items 200 --rounds 3 --kernel fused --scheduler continuous

Figures, per round and as medians:
  in-process decode tok/s   decode tokens / wall time of decode steps (the run's own definition)
  in-process output tok/s   output tokens / wall time of generate()
  in-process cN ...         the same, with at most N requests in the engine at once (a new one
                            joins when one finishes), as the HTTP client offers them: the same
                            workload as the server sees, without HTTP
  HTTP decode tok/s         the client's: tokens after each request's first / time at least one
                            request was past its first token (moebench.backends.openai)
  HTTP output tok/s         output tokens / wall time from the first request sent to the last answer
  server decode tok/s       the server's own step records (evidence endpoint), this round's share
  CPU seconds               in-process: this process's CPU time in generate(); HTTP: the server's
                            (front end and engine process, all threads, from /proc), the engine
                            process's alone (its evidence) and the client's; on a loaded shared
                            machine CPU time is steadier than wall time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a server (all threads of all processes of its process group: the
    HTTP front end and the engine process) from /proc."""
    group, total = os.getpgid(pid), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == group:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def in_process_at_concurrency(engine, requests, prompt_ids, concurrency):
    """Engine steps with at most `concurrency` requests in the engine: one joins between steps for
    each that finished. Returns (completions in request order, decode tokens, decode s, wall s, steps, decode steps)."""
    from moebench.engine.sequence import Sequence

    session = engine.session(max(len(ids) for ids in prompt_ids) + max(r.max_new_tokens for r in requests))
    started = time.perf_counter()
    queue = list(range(len(requests)))[::-1]

    def admit():
        i = queue.pop()
        session.add(Sequence(requests[i], list(prompt_ids[i]), requests[i].max_new_tokens, time.perf_counter()))

    for _ in range(min(concurrency, len(queue))):
        admit()
    decode_tokens = decode_s = 0.0
    seen = steps = decode_steps = 0
    try:
        while session.has_work():
            record = session.step().to_dict()
            steps += 1
            if record["phase"] != "prefill":
                decode_steps += 1
                decode_tokens += record["decode_tokens"]
                decode_s += record["duration_s"]
            while seen < len(session.completions):
                seen += 1
                if queue:
                    admit()
    finally:
        session.close()
    wall = time.perf_counter() - started
    order = {r.id: i for i, r in enumerate(requests)}
    return sorted(session.completions, key=lambda c: order[c.id]), decode_tokens, decode_s, wall, steps, decode_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kernel", default="fused")
    ap.add_argument("--scheduler", default="continuous")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()

    import httpx
    import torch

    torch.set_num_threads(1)
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.loader import load_tokenizer
    from moebench.backends.openai import ClientOptions, OpenAIEngine
    from moebench.measuring.run import bundled_model_path
    from moebench.serve.app import ServeProcess
    from moebench.suites import load_suite

    path = bundled_model_path()
    suite = load_suite("gsm-synth", limit=a.items)
    tokenizer = load_tokenizer(path)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    runtime = RuntimeConfig(kernel=a.kernel, scheduler=a.scheduler, batch_size=a.batch_size,
                            max_new_tokens=a.max_new_tokens)
    requests = [Request(item.id, suite.prompt(item), a.max_new_tokens, tuple(suite.stop)) for item in suite.items]
    prompt_ids = [tokenizer.encode(r.prompt).ids for r in requests]
    load = os.getloadavg()

    rounds = []
    server_args = ["--kernel", a.kernel, "--scheduler", a.scheduler, "--batch-size", str(a.batch_size),
                   "--max-new-tokens", str(a.max_new_tokens)]
    with ServeProcess(server_args) as server:
        client = OpenAIEngine(server.url, ClientOptions(concurrency=a.concurrency), served_model="bundled",
                              tokenizer=tokenizer)
        Engine(ckpt, tokenizer, runtime).generate(requests[:32])  # warm both sides alike
        client.generate(requests[:32])
        for r in range(a.rounds):  # A B, A B, ...: drift on a shared machine hits both alike
            cpu = time.process_time()
            local = Engine(ckpt, tokenizer, runtime).generate(requests)
            local_cpu = time.process_time() - cpu
            cpu = time.process_time()
            capped, c_tok, c_s, c_wall, c_steps, c_decode_steps = in_process_at_concurrency(
                Engine(ckpt, tokenizer, runtime), requests, prompt_ids, a.concurrency)
            capped_cpu = time.process_time() - cpu
            d_tok, d_s = local.phase_totals("decode_tokens", ("decode", "mixed"))
            out_tok = sum(len(c.output_ids) for c in local.completions)

            before = httpx.get(server.url + "/v1/moebench/evidence").json()
            server_cpu, client_cpu = _cpu_s(server.proc.pid), time.process_time()
            started = time.perf_counter()
            remote = client.generate(requests)
            wall = time.perf_counter() - started
            server_cpu, client_cpu = _cpu_s(server.proc.pid) - server_cpu, time.process_time() - client_cpu
            after = httpx.get(server.url + "/v1/moebench/evidence").json()
            failed = [c for c in remote.completions if c.error]
            http_tokens = sum(c.output_tokens for c in remote.completions)
            same = sum(x.text == y.text for x, y in zip(local.completions, remote.completions))
            same_capped = sum(x.text == y.text for x, y in zip(local.completions, capped))
            row = {
                "round": r,
                "inproc_decode_tok_s": d_tok / d_s,
                "inproc_output_tok_s": out_tok / local.wall_s,
                "inproc_c_decode_tok_s": c_tok / c_s,
                "inproc_c_output_tok_s": sum(len(c.output_ids) for c in capped) / c_wall,
                "http_decode_tok_s": remote.decode_tokens / remote.decode_s,
                "http_output_tok_s": http_tokens / wall,
                "server_decode_tok_s": (after["decode_tokens"] - before["decode_tokens"])
                / max(after["decode_s"] - before["decode_s"], 1e-9),
                # where the server's time went: steps (prefill + decode) against the client's wall
                "inproc_steps": len(local.steps),
                "inproc_c_steps": c_steps,
                "inproc_c_cpu_s": capped_cpu,
                "inproc_c_decode_batch": c_tok / max(1, c_decode_steps),
                "server_steps": after["steps"] - before["steps"],
                # rows per decode step: how full the server's batches were
                "server_decode_batch": (after["decode_tokens"] - before["decode_tokens"]) / max(1, (
                    after["steps"] - before["steps"]) - (after["evidence"]["scheduler"].get("prefill_steps", 0)
                                                          - before["evidence"]["scheduler"].get("prefill_steps", 0))),
                "inproc_wall_s": local.wall_s,
                "http_wall_s": wall,
                "server_step_s": (after["decode_s"] + after["prefill_s"]) - (before["decode_s"] + before["prefill_s"]),
                "server_idle_s": after["idle_s"] - before["idle_s"],
                "inproc_cpu_s": local_cpu,
                "server_cpu_s": server_cpu,
                "engine_cpu_s": after["engine_cpu_s"] - before["engine_cpu_s"],
                "client_cpu_s": client_cpu,
                "identical_outputs": same,
                "identical_outputs_inproc_c": same_capped,
                "items": len(requests),
                "failed_requests": len(failed),
                "output_tokens": [out_tok, http_tokens],
            }
            rounds.append(row)
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        evidence = httpx.get(server.url + "/v1/moebench/evidence").json()

    def med(key):
        return statistics.median(row[key] for row in rounds)

    summary = {
        "workload": f"gsm-synth {a.items} items, max_new_tokens {a.max_new_tokens}, batch {a.batch_size}, "
                    f"kernel {a.kernel}, scheduler {a.scheduler}, concurrency {a.concurrency}, 1 torch thread",
        "load_before": load, "load_after": os.getloadavg(),
        "median": {k: med(k) for k in ("inproc_decode_tok_s", "inproc_output_tok_s", "inproc_c_decode_tok_s",
                                       "inproc_c_output_tok_s", "http_decode_tok_s", "http_output_tok_s",
                                       "server_decode_tok_s")},
        "rounds": rounds,
        "server_activation_errors": evidence["activation_errors"],
        "server_backends": evidence["backends"],
        "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }
    m = summary["median"]
    per_round = {
        "http_output / inproc_output": [r["http_output_tok_s"] / r["inproc_output_tok_s"] for r in rounds],
        "inproc_cpu / server_cpu": [r["inproc_cpu_s"] / r["server_cpu_s"] for r in rounds],
        "http_output / inproc_c_output": [r["http_output_tok_s"] / r["inproc_c_output_tok_s"] for r in rounds],
        "server_decode / inproc_c_decode": [r["server_decode_tok_s"] / r["inproc_c_decode_tok_s"] for r in rounds],
        "inproc_c_cpu / server_cpu": [r["inproc_c_cpu_s"] / r["server_cpu_s"] for r in rounds],
        "inproc_c_cpu / engine_cpu": [r["inproc_c_cpu_s"] / r["engine_cpu_s"] for r in rounds],
    }
    summary["per_round_ratio_median"] = {k: statistics.median(v) for k, v in per_round.items()}
    summary["ratios"] = {
        "http_decode / inproc_decode": m["http_decode_tok_s"] / m["inproc_decode_tok_s"],
        "http_output / inproc_output": m["http_output_tok_s"] / m["inproc_output_tok_s"],
        "server_decode / inproc_decode": m["server_decode_tok_s"] / m["inproc_decode_tok_s"],
    }
    print(json.dumps({"median": m, "ratios": summary["ratios"], "per_round_ratio_median": summary["per_round_ratio_median"],
                      "load": [load, summary["load_after"]]}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if any(row["identical_outputs"] != row["items"] or row["identical_outputs_inproc_c"] != row["items"]
           or row["failed_requests"] for row in rounds):
        sys.exit(1)


if __name__ == "__main__":
    main()
