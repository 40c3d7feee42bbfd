"""What one speculative verify step costs against a plain decode step: the forward of B sequences with
one row each (a plain decode step) against the forward of the same B sequences with K + 1 rows each
(the last token and K drafts, engine/speculative.py), over the same paged KV cache at the same
context length.

    python benchmarks/spec_verify_cost.py --model bundled --batch 1 16 --k 2 4
    python benchmarks/spec_verify_cost.py --model random-0.89b --batch 1 --k 4 --layers 8

Prints the median milliseconds per forward of interleaved rounds, the ratio verify / plain of the
medians, and the median and range of the per-round ratios (each verify timing over the plain one of
its round). The break-even acceptance: a verify step emitting T tokens on average pays off when T >
that ratio.

    python benchmarks/spec_verify_cost.py --model bundled --batch 1 16 --k 1 2 4 --mtp

`--mtp` (a checkpoint with an MTP head, engine/mtp.py) times the steps as an MTP session runs them
(the model keeps its hidden states) and adds the head's forward over one row per sequence (a
chained draft) and two (catching up after one accepted draft): an MTP verify step with K drafts
costs the verify forward plus about K head forwards.

Each forward's bytes (experts the rows routed to, as the engine counts them for a step's
`bytes_read`, plus the other weights and the K/V read) and the machine's read bandwidth give its
floor: no forward reads its bytes faster than the bandwidth allows. The floor's ratio to the plain
forward as measured bounds the verify ratio from below whatever the code: a sparse MoE's extra rows
route to experts of their own, so a verify forward reads more than a plain one. The ratio of the
bytes is the verify's floor at the plain forward's own read rate: a bandwidth-bound verify that
reads no faster than the plain forward does costs at least that many plain forwards.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def _float32_copy(head):
    """The head with its matrices widened to float32 (the same values), or None where they already are."""
    import copy

    import torch

    from moebench.engine.mtp import MtpHead

    if head.w.eh_proj.dtype == torch.float32:
        return None
    w = copy.deepcopy(head.w)
    for name in ("qkv_proj", "o_proj", "dense_w13", "dense_w2"):
        if getattr(w.block, name) is not None:
            setattr(w.block, name, getattr(w.block, name).float().contiguous())
    w.eh_proj = w.eh_proj.float()
    return MtpHead(w, head.model, head.kv.num_blocks, head.kv.block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="bundled, random-0.89b, or a checkpoint directory")
    parser.add_argument("--layers", type=int, default=None, help="random-0.89b: override the layer count")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--k", type=int, nargs="+", default=[4])
    parser.add_argument("--context", type=int, default=160, help="tokens already cached per sequence")
    parser.add_argument("--kernel", default="fused")
    parser.add_argument("--decode-path", default="auto")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mtp", action="store_true", help="also time the checkpoint's MTP head (engine/mtp.py)")
    args = parser.parse_args()

    import torch

    from moebench.engine import Engine, RuntimeConfig
    from moebench.engine.runner import build_forward_batch
    from moebench.engine.speculative import draft_context_reads

    torch.set_num_threads(1)
    from moebench.measuring.bench_models import benchmark_checkpoint
    from moebench.measuring.machine import measure_read_bandwidth_gb_s

    bandwidth = measure_read_bandwidth_gb_s()
    print(f"read bandwidth {bandwidth:.1f} GB/s (harness/measuring/machine.py, huge pages)")
    with tempfile.TemporaryDirectory(prefix="moebench-spec-cost-") as tmp:
        ckpt = benchmark_checkpoint(args.model, Path(tmp), layers=args.layers)
        rt = RuntimeConfig(kernel=args.kernel, decode_path=args.decode_path, batch_size=max(args.batch))
        engine = Engine(ckpt, None, rt)
        session = engine.session(args.context + max(args.k) + 2)
        head = None
        if args.mtp:
            from moebench.engine.mtp import make_mtp_drafter

            head = make_mtp_drafter(ckpt, session.model, session.block_manager.num_blocks, rt.kv_block_size).head
            head_f32 = _float32_copy(head)  # the head as it was held before (docs/speculative.md)
        g = torch.Generator().manual_seed(0)
        vocab = ckpt.config.vocab_size
        print(f"model {args.model}: {ckpt.config.num_layers} layers, hidden {ckpt.config.hidden_size}, vocab {vocab}; "
              f"context {args.context}; decode path {session.runner.name}")
        bs = rt.kv_block_size
        for b in args.batch:
            tables = []
            for _ in range(b):
                table: list[int] = []
                session.block_manager.ensure_capacity(table, args.context + max(args.k) + 1)
                tables.append(table)
            # the context's K/V: one prefill of random tokens per sequence
            prompts = torch.randint(1, vocab, (b, args.context), generator=g).tolist()
            session.model.forward(build_forward_batch(prompts, [0] * b, tables, bs, rt.device), session.kv)
            last = torch.randint(1, vocab, (b, max(args.k) + 1), generator=g).tolist()

            def batch_of(k):
                rows, cached, tabs = [], [], []
                for seq in range(b):
                    for j in range(k + 1):
                        rows.append([last[seq][j]])
                        cached.append(args.context + j)
                        tabs.append(tables[seq])
                return build_forward_batch(rows, cached, tabs, bs, rt.device)

            batches = {0: batch_of(0), **{k: batch_of(k) for k in args.k}}
            runs = {k: (lambda fb=fb: session.runner.run(fb, session.kv)) for k, fb in batches.items()}
            if head is not None:
                H = ckpt.config.hidden_size
                for rows in (1, 2):
                    toks = [last[seq][j] for seq in range(b) for j in range(rows)]
                    pos = [args.context - 1 + j for seq in range(b) for j in range(rows)]
                    tabs = [tables[seq] for seq in range(b) for _ in range(rows)]
                    hid = torch.randn(b * rows, H, generator=g)
                    runs[f"head{rows}"] = lambda t=toks, h=hid, p=pos, tb=tabs: head.forward(t, h, p, tb)
                    if head_f32 is not None:
                        runs[f"head{rows}f32"] = lambda t=toks, h=hid, p=pos, tb=tabs: head_f32.forward(t, h, p, tb)
            # bytes per forward: the routed experts of each forward as the engine counts them
            reads = {}
            for k, fb in batches.items():
                session.stats.take_step()
                session.runner.run(fb, session.kv)  # a decode step's threads, as the engine runs it
                routing = session.stats.take_step()
                seqs = [SimpleNamespace(prompt_ids=[0] * (args.context + 1), output_ids=[]) for _ in range(b)]
                reread = b * draft_context_reads(args.context, k)
                reads[k] = (routing["distinct_experts"], engine.bytes_read(routing, seqs, reread))
            times = {k: [] for k in runs}
            for _ in range(args.rounds):
                for k, run in runs.items():
                    run()  # warm (the runner enters a decode step's threads itself, as in the engine)
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        run()
                    times[k].append((time.perf_counter() - t) / args.steps * 1e3)
            plain = statistics.median(times[0])

            def ratio(k):
                # per round, verify over the plain forward timed beside it: on a shared machine the
                # load moves between rounds more than between adjacent forwards of one round
                ratios = sorted(v / p for v, p in zip(times[k], times[0]))
                return (f"{statistics.median(times[k]) / plain:.2f}x; per round median {statistics.median(ratios):.2f}x, "
                        f"{ratios[0]:.2f}-{ratios[-1]:.2f}")

            cells = [f"plain {plain:.3f} ms"] + [f"K={k}: {statistics.median(times[k]):.3f} ms ({ratio(k)})"
                                                 for k in args.k]
            cells += [f"MTP head{' (float32 copy)' if k.endswith('f32') else ''}, {k[4:].removesuffix('f32')} row(s) per "
                      f"sequence: {statistics.median(times[k]):.3f} ms ({ratio(k)})" for k in runs if str(k).startswith("head")]
            print(f"batch {b:>3}: " + ", ".join(cells))
            floor = {k: reads[k][1] / bandwidth / 1e6 for k in reads}  # ms at the read bandwidth
            print("           bytes: " + ", ".join(
                f"{'plain' if k == 0 else f'K={k}'} {reads[k][1] / 1e6:.1f} MB ({reads[k][0]:.1f} experts per MoE layer, "
                f"floor {floor[k]:.3f} ms" + ("" if k == 0 else f" = {floor[k] / plain:.2f}x the plain forward as measured; "
                                                 f"{reads[k][1] / reads[0][1]:.2f}x its bytes") + ")"
                for k in reads))
            for table in tables:
                session.block_manager.free(table)
        session.close()


if __name__ == "__main__":
    main()
