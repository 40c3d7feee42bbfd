"""Sampled tokens through `moebench serve` equal the in-process engine's for the same seeds.

    python benchmarks/sampling_serve_check.py --items 50 --temperature 0.6 [--top-p P] [--top-k K]

The in-process side builds its requests as `moebench run` does (harness/measuring/measure.py: the seed of
each from (--seed, --trial, item id)) and runs the baseline engine (naive kernel, static batches).
The server runs the optimized switches (fused kernel, continuous batching) as a real process and
gets the same prompts as token ids with each request's seed in OpenAI's `seed` field, all at once.
Prints how many items' texts match (the server answers text; the in-process text is the same
detokenization of the same ids), and how many of the in-process samples left the greedy path,
which says whether the comparison could have failed at all.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trial", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--server-args", default="--kernel fused --scheduler continuous --batch-size 16",
                        help="switches of the server (default: the optimized ones)")
    args = parser.parse_args()

    import httpx
    import torch

    from moebench.engine import Engine, RuntimeConfig, load_checkpoint
    from moebench.engine.loader import load_tokenizer
    from moebench.measuring.measure import _requests, run_sampling
    from moebench.measuring.args import RunArgs
    from moebench.measuring.run import bundled_model_path
    from moebench.serve.app import ServeProcess
    from moebench.suites import load_suite

    torch.set_num_threads(1)
    path = bundled_model_path()
    suite = load_suite("gsm-synth", limit=args.items)
    tokenizer = load_tokenizer(path)
    sampling = run_sampling(RunArgs(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed))
    requests = _requests(suite, suite.items, args.max_new_tokens, sampling, args.trial)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    runtime = RuntimeConfig(batch_size=16, max_new_tokens=args.max_new_tokens)
    local = Engine(ckpt, tokenizer, runtime).generate(requests)
    greedy = Engine(ckpt, tokenizer, runtime).generate(_requests(suite, suite.items, args.max_new_tokens))
    left_greedy = sum(a.output_ids != b.output_ids for a, b in zip(local.completions, greedy.completions))

    async def ask(url):
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(request):
                s = request.sampling
                body = {"prompt": tokenizer.encode(request.prompt).ids, "max_tokens": args.max_new_tokens,
                        "stop": list(request.stop), "temperature": s.temperature, "top_p": s.top_p,
                        "top_k": s.top_k or -1, "seed": s.seed}
                r = await client.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["choices"][0]["text"]
            return await asyncio.gather(*(one(r) for r in requests))

    with ServeProcess(args.server_args.split() + ["--max-new-tokens", str(args.max_new_tokens)]) as server:
        texts = asyncio.run(ask(server.url))
        evidence = httpx.get(server.url + "/v1/moebench/evidence", timeout=60).json()
    same_text = sum(t == c.text for t, c in zip(texts, local.completions))
    print(f"sampling {sampling}")
    print(f"server: {args.server_args}; in-process: naive kernel, static batches of 16")
    print(f"items {len(requests)}: identical text {same_text}/{len(requests)}; in-process samples that left "
          f"the greedy path: {left_greedy}/{len(requests)}")
    print(f"server's sampling evidence: {evidence['evidence']['sampling']}")
    return 0 if same_text == len(requests) else 1


if __name__ == "__main__":
    sys.exit(main())
