"""How accurately moebench's OpenAI client (moebench.backends.openai) measures a server, and how
punctually it sends under open-loop load, against a synthetic server whose timings are known.

    python benchmarks/client_accuracy.py                    # parts a, b, c
    python benchmarks/client_accuracy.py --serve            # and d: `moebench serve`, bundled model
    python benchmarks/client_accuracy.py --hog --out docs/measurements/client-accuracy-hog.json

The synthetic server (tests/fixtures/synthetic_server.py) runs as a process of its own: first
token `--ttft` after it reads a request, then one every `--token-interval`; it records when it
read each request and when it wrote each token. perf_counter is CLOCK_MONOTONIC on Linux, one
clock for both processes, so the client's readings are compared with the server's directly.

  a  closed loop, --concurrency streams: the client's inter-token latencies against the nominal
     interval and against the server's actual write intervals; its TTFT against the nominal
     TTFT and against the true one (server's first write minus the client's send); how long a
     token takes from the server's write to the client's reading (delivery)
  b  open loop at --rate requests/s (Poisson) for --duration s: send lag (sent - scheduled, the
     client's own lateness) P50/P99/max, and from the schedule to the server's receipt
  c  a sweep of rates: the highest one whose send lag P99 stays within --lag-target
  d  (--serve) open loop against `moebench serve` on the bundled model, small max_tokens
Client CPU per streamed chunk is reported with each part (time.process_time of this process).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

import moebench.backends.openai as openai_client
from moebench.backends.openai import ClientOptions, OpenAIEngine
from moebench.measuring.arrivals import Load

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "fixtures" / "synthetic_server.py"


@dataclass
class Req:  # what the client reads of a suite request
    id: str
    prompt: str
    max_new_tokens: int
    stop: tuple = ()


class Synthetic:
    """The synthetic server as a child process, for a `with` block."""

    def __init__(self, ttft: float, interval: float):
        self.args = [sys.executable, str(SERVER), "--port", "0", "--ttft", str(ttft), "--token-interval", str(interval)]

    def __enter__(self) -> "Synthetic":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening "):
            self.proc.kill()
            raise RuntimeError(f"synthetic server did not start: {line!r}")
        self.url = line.split(" ", 1)[1]
        return self

    def records(self) -> dict:
        return httpx.get(self.url + "/synthetic/requests", timeout=30).json()

    def reset(self) -> None:
        httpx.post(self.url + "/synthetic/reset", timeout=30)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def pct(values, q) -> float | None:
    v = np.asarray(values, dtype=float)
    return float(np.percentile(v, q)) if v.size else None


def ms(x):
    return None if x is None else round(x * 1e3, 4)


def summary_ms(values) -> dict:
    return {"n": len(values), "p50_ms": ms(pct(values, 50)), "p90_ms": ms(pct(values, 90)),
            "p99_ms": ms(pct(values, 99)), "max_ms": ms(max(values) if len(values) else None),
            "mean_ms": ms(float(np.mean(values)) if len(values) else None)}


class CollectorPauses:
    """The cyclic garbage collector's runs in this process (each one stops the event loop)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def take(self) -> dict:
        p, self.pauses = self.pauses, []
        return {"collections": len(p), "full": sum(g == 2 for g, _ in p),
                "longest_ms": ms(max((d for _, d in p), default=0.0))}


COLLECTOR = CollectorPauses()


def run_client(url: str, served: str, requests: list[Req], concurrency: int, arrivals=None) -> tuple:
    engine = OpenAIEngine(url, ClientOptions(concurrency=concurrency, retries=3), served_model=served)
    COLLECTOR.take()
    cpu = time.process_time()
    result = engine.generate(requests, arrivals=arrivals)
    return result, time.process_time() - cpu


def compare(result, server: dict, ttft: float, interval: float, completions=None) -> dict:
    """The client's figures beside the server's record of the same requests (matched by prompt);
    `completions`: a subset of the result's."""
    completions = result.completions if completions is None else completions
    by_prompt = {r["prompt"]: r for r in server["requests"]}
    itl, true_itl, delivery, ttft_err, ttft_true_err, to_server = [], [], [], [], [], []
    tokens_ok = 0
    for c in completions:
        rec = by_prompt.get(c.id)
        if c.error is not None or rec is None:
            continue
        tokens_ok += c.output_tokens == rec["max_tokens"]
        itl += c.itl_s
        emits = rec["emits"]
        true_itl += [b - a for a, b in zip(emits, emits[1:])]
        arrivals = [c.sent_at + t for t in c.token_times]
        if len(arrivals) == len(emits):
            delivery += [a - e for a, e in zip(arrivals, emits)]
        ttft_err.append(c.ttft_s - ttft)
        ttft_true_err.append(c.ttft_s - (emits[0] - c.sent_at))
        to_server.append(rec["received"] - c.sent_at)
    out = {
        "completed": sum(c.error is None for c in completions),
        "failed": sum(c.error is not None for c in completions),
        "token_count_right": tokens_ok,
        "itl_client": summary_ms(itl),
        "itl_server_actual": summary_ms(true_itl),
        "itl_median_error_vs_nominal_pct": (round((pct(itl, 50) / interval - 1) * 100, 3) if itl else None),
        "itl_median_error_vs_server_pct": (round((pct(itl, 50) / pct(true_itl, 50) - 1) * 100, 3) if itl else None),
        "ttft_error_vs_nominal": summary_ms(ttft_err),
        "ttft_error_vs_true": summary_ms(ttft_true_err),
        "delivery_write_to_read": summary_ms(delivery),
        "send_to_server_receipt": summary_ms(to_server),
        "max_in_flight_at_server": server["max_in_flight"],
        "garbage_collector": COLLECTOR.take(),
        "wall_s": round(result.wall_s, 3),
    }
    lags = [c.sent_s - c.scheduled_s for c in completions if c.scheduled_s is not None]
    if lags:
        out["send_lag"] = summary_ms(lags)
        # the schedule in absolute terms: the trial started at sent_at - sent_s (first attempts)
        sched_to_receipt = [by_prompt[c.id]["received"] - (c.sent_at - c.sent_s + c.scheduled_s)
                            for c in completions if c.attempts == 1 and c.id in by_prompt]
        out["schedule_to_server_receipt"] = summary_ms(sched_to_receipt)
    return out


def chunks_of(result) -> int:
    return sum(len(c.token_times) for c in result.completions)


def open_loop(url, served, rate, duration, tokens, seed, label):
    n = max(2, int(rate * duration))
    offsets = Load(f"{rate:g}/s", rate).offsets(n, seed)
    requests = [Req(f"{label}-{i}", f"{label}-{i}", tokens) for i in range(n)]
    return run_client(url, served, requests, concurrency=1, arrivals=offsets)


def row(name, m, cpu, chunks) -> str:
    lag = m.get("send_lag") or {}
    return (f"{name:<28} done {m['completed']:>5} fail {m['failed']:>3}  ITL p50 {m['itl_client']['p50_ms'] or 0:7.3f} ms "
            f"(server {m['itl_server_actual']['p50_ms'] or 0:7.3f})  TTFT err p50/p99 "
            f"{m['ttft_error_vs_nominal']['p50_ms'] or 0:6.3f}/{m['ttft_error_vs_nominal']['p99_ms'] or 0:6.3f} ms  "
            + (f"lag p50/p99/max {lag['p50_ms']:.3f}/{lag['p99_ms']:.3f}/{lag['max_ms']:.3f} ms  " if lag else "")
            + f"client CPU {cpu / max(chunks, 1) * 1e6:.1f} us/chunk")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "docs" / "measurements" / "client-accuracy.json"))
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--token-interval", type=float, default=0.010)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--closed-requests", type=int, default=96)
    p.add_argument("--closed-tokens", type=int, default=80)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--duration", type=float, default=25.0, help="seconds of open-loop arrivals in part b")
    p.add_argument("--open-tokens", type=int, default=32, help="max_tokens per open-loop request")
    p.add_argument("--sweep", default="25,50,100,150,200,300,400", help="rates of part c, requests/s ('' skips it)")
    p.add_argument("--sweep-duration", type=float, default=10.0)
    p.add_argument("--lag-target", type=float, default=0.005, help="send lag P99 a rate must keep, seconds")
    p.add_argument("--serve", action="store_true", help="part d: open loop against `moebench serve`")
    p.add_argument("--serve-rate", type=float, default=50.0)
    p.add_argument("--serve-duration", type=float, default=10.0)
    p.add_argument("--serve-tokens", type=int, default=4)
    p.add_argument("--serve-args", default="--kernel fused --scheduler continuous",
                   help="switches for `moebench serve` (space-separated)")
    p.add_argument("--hog", action="store_true", help="one busy-loop process beside it all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--imports", default="",
                   help="modules to import first (e.g. torch,transformers,moebench.measuring.run): the heap "
                        "of a `moebench run` process, which a full garbage collection has to walk")
    p.add_argument("--spin-ms", type=float, default=None,
                   help="how long before a send the client stops sleeping and yields (default: the client's own)")
    a = p.parse_args()
    if a.spin_ms is not None:
        openai_client.SPIN_S = a.spin_ms / 1e3
    for name in filter(None, a.imports.split(",")):
        importlib.import_module(name)

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.hog else None
    out: dict = {"machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                             "hog": a.hog, "load_average_at_start": os.getloadavg()},
                 "imports": a.imports, "spin_s": openai_client.SPIN_S, "gc_tracked_objects": len(gc.get_objects()),
                 "argv": sys.argv[1:], "nominal": {"ttft_s": a.ttft, "token_interval_s": a.token_interval}}
    try:
        with Synthetic(a.ttft, a.token_interval) as server:
            warm = [Req(f"warm-{i}", f"warm-{i}", 4) for i in range(a.concurrency)]
            run_client(server.url, "synthetic", warm, a.concurrency)  # connections, imports
            server.reset()

            requests = [Req(f"closed-{i}", f"closed-{i}", a.closed_tokens) for i in range(a.closed_requests)]
            result, cpu = run_client(server.url, "synthetic", requests, a.concurrency)
            records = server.records()
            m = compare(result, records, a.ttft, a.token_interval)
            m["client_cpu_us_per_chunk"] = round(cpu / max(chunks_of(result), 1) * 1e6, 2)
            m["client_cpu_s"] = round(cpu, 3)
            # the first wave opens its connections (each generate() has a session of its own) and
            # reaches the server all at once; the requests after it reuse them, one at a time
            later = compare(result, records, a.ttft, a.token_interval, result.completions[a.concurrency:])
            m["after_first_wave"] = {k: later[k] for k in ("ttft_error_vs_nominal", "ttft_error_vs_true",
                                                          "send_to_server_receipt", "itl_client")}
            out["a_closed"] = {"concurrency": a.concurrency, "requests": a.closed_requests,
                               "max_tokens": a.closed_tokens, **m}
            print(row(f"a closed c{a.concurrency}", m, cpu, chunks_of(result)), flush=True)
            print(row("  after the first wave", later, cpu, chunks_of(result)), flush=True)
            print(f"  TTFT error vs true (server's first write - client send) p50/p99 "
                  f"{m['ttft_error_vs_true']['p50_ms']}/{m['ttft_error_vs_true']['p99_ms']} ms; "
                  f"send to server receipt p50/p99 {m['send_to_server_receipt']['p50_ms']}/"
                  f"{m['send_to_server_receipt']['p99_ms']} ms", flush=True)
            server.reset()

            result, cpu = open_loop(server.url, "synthetic", a.rate, a.duration, a.open_tokens, a.seed, "open")
            m = compare(result, server.records(), a.ttft, a.token_interval)
            m["client_cpu_us_per_chunk"] = round(cpu / max(chunks_of(result), 1) * 1e6, 2)
            m["client_cpu_s"] = round(cpu, 3)
            out["b_open"] = {"rate": a.rate, "duration_s": a.duration, "max_tokens": a.open_tokens, **m}
            print(row(f"b open {a.rate:g}/s", m, cpu, chunks_of(result)), flush=True)
            server.reset()

            sweep, best = [], None
            for rate in [float(x) for x in a.sweep.split(",") if x.strip()]:
                result, cpu = open_loop(server.url, "synthetic", rate, a.sweep_duration, a.open_tokens, a.seed,
                                        f"sweep{rate:g}")
                m = compare(result, server.records(), a.ttft, a.token_interval)
                m["client_cpu_us_per_chunk"] = round(cpu / max(chunks_of(result), 1) * 1e6, 2)
                m["client_cpu_s"] = round(cpu, 3)
                print(row(f"c sweep {rate:g}/s", m, cpu, chunks_of(result)), flush=True)
                server.reset()
                m["within_target"] = m["failed"] == 0 and m["send_lag"]["p99_ms"] <= a.lag_target * 1e3
                if m["within_target"] and all(pt["within_target"] for pt in sweep):
                    best = rate
                sweep.append({"rate": rate, **m})
            if sweep:
                out["c_sweep"] = {"duration_s": a.sweep_duration, "max_tokens": a.open_tokens,
                                  "lag_target_ms": a.lag_target * 1e3, "highest_rate_within_target": best,
                                  "points": sweep}
                print(f"c highest rate with send lag P99 <= {a.lag_target * 1e3:g} ms (and at every lower rate): {best}",
                      flush=True)
            out["e_cpu"] = cpu_part(server, a)
        save(out, a.out)  # what was measured stays measured, whatever part d does
        if a.serve:
            try:
                out["d_serve"] = serve_part(a)
            except Exception as e:  # noqa: BLE001 (a server that never came up is a result too)
                out["d_serve"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"d serve: {out['d_serve']['error']}", flush=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    save(out, a.out)
    print(f"wrote {a.out}")


def save(out: dict, path: str) -> None:
    out["machine"]["load_average_at_end"] = os.getloadavg()  # other work on a shared machine shows here
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


def cpu_part(server: Synthetic, a) -> dict:
    """The client's CPU per request and per streamed chunk: the same open-loop schedule with one
    token per request and with 64, the difference being the chunks' cost."""
    runs = {}
    for tokens in (1, 64):
        result, cpu = open_loop(server.url, "synthetic", a.rate, 6.0, tokens, a.seed, f"cpu{tokens}")
        server.reset()
        runs[tokens] = (len(result.completions), chunks_of(result), cpu)
    (n1, c1, cpu1), (n64, c64, cpu64) = runs[1], runs[64]
    m = {"rate": a.rate, "duration_s": 6.0, "requests": n1, "cpu_s_1_token": round(cpu1, 3),
         "cpu_s_64_tokens": round(cpu64, 3), "us_per_request": round(cpu1 / n1 * 1e6, 1),
         "us_per_chunk": round((cpu64 - cpu1) / max(c64 - c1, 1) * 1e6, 1)}
    print(f"e client CPU at {a.rate:g}/s: {m['us_per_request']} us per request (1 token each), "
          f"{m['us_per_chunk']} us per further chunk (64 tokens each)", flush=True)
    return m


def serve_part(a) -> dict:
    from moebench.serve.app import ServeProcess

    # the first start after a kernel change compiles the CPU kernels: minutes on two busy cores
    with ServeProcess(a.serve_args.split(), startup_timeout_s=900.0) as server:
        warm = [Req(f"warm-{i}", "1 + 1 =", a.serve_tokens) for i in range(8)]
        run_client(server.url, "bundled", warm, 8)
        n = max(2, int(a.serve_rate * a.serve_duration))
        offsets = Load(f"{a.serve_rate:g}/s", a.serve_rate).offsets(n, a.seed)
        requests = [Req(f"serve-{i}", f"Question {i}: what is {i} + {i}? Answer:", a.serve_tokens) for i in range(n)]
        result, cpu = run_client(server.url, "bundled", requests, 1, arrivals=offsets)
    lags = [c.sent_s - c.scheduled_s for c in result.completions]
    ok = [c for c in result.completions if c.error is None]
    m = {"rate": a.serve_rate, "duration_s": a.serve_duration, "max_tokens": a.serve_tokens,
         "server_args": a.serve_args, "requests": n, "completed": len(ok), "failed": result.failed_requests,
         "retried": sum(c.attempts > 1 for c in result.completions), "send_lag": summary_ms(lags),
         "ttft": summary_ms([c.ttft_s for c in ok]), "latency": summary_ms([c.latency_s for c in ok]),
         "wall_s": round(result.wall_s, 3), "client_cpu_s": round(cpu, 3)}
    lag = m["send_lag"]
    print(f"d serve {a.serve_rate:g}/s  done {len(ok)} fail {m['failed']} retried {m['retried']}  "
          f"lag p50/p99/max {lag['p50_ms']:.3f}/{lag['p99_ms']:.3f}/{lag['max_ms']:.3f} ms  "
          f"TTFT p50 {m['ttft']['p50_ms']} ms", flush=True)
    return m


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
