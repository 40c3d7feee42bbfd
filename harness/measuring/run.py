"""`moebench run`: measure one configuration, or the ablation matrix, on a suite.

Trials are interleaved (A B C ... A B C ...) after a warm-up so that drift on a shared machine
hits every configuration alike. Samples are appended as they complete, so an interrupted run
keeps them and `--resume` continues it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import secrets
import shlex
import sys
from pathlib import Path


from moebench.ablation import (DECODE_PATH_AXIS, FULL_WEIGHTS, LM_HEAD_AXIS, LOW_PRECISION_HEADS, LOW_PRECISION_WEIGHTS, OFF, SPECULATIVE_AXIS, SWITCHES,
                               WEIGHTS_AXIS, ConfigPoint,
                               ablation_matrix, negative_control, parse_axes, point, resident_reference)
from moebench.ablation import parse_budget as _parse_budget  # (lm-eval and serve import it from here)
from moebench.ablation import runtime_for as _runtime_for
from moebench.models.bundled import BUNDLED_MODEL, bundled_model_path  # noqa: F401 (imported from here)
from moebench.engine.config import KERNELS, LM_HEADS, PREFETCHERS, SCHEDULERS, WEIGHT_PRECISIONS
from moebench.errors import MoebenchError, describe_os_error
from moebench.fileio import atomic_write_json, drop_torn_tail, ensure_writable_dir, read_jsonl
from moebench.engine.sampling import check_sampling_options
from moebench.measuring.args import RunArgs

# the engine's own lists of strategy names: one source of truth for what each switch accepts
IMPLEMENTED = {"kernel": KERNELS, "scheduler": SCHEDULERS, "prefetch": PREFETCHERS}


def _budget_text(args: RunArgs) -> str:
    """The run's expert budget: as given, else 0.5 for the bundled default's ablation (offloading is
    part of what it measures) unless it ablates the decode path (whose native point needs every
    expert resident), else 1.0."""
    budget = args.expert_budget
    if budget is None:
        offloaded = args.ablate and args.model is None and DECODE_PATH_AXIS not in parse_axes(args.axes)[1]
        budget = "0.5" if offloaded else "1.0"
    return budget


def _model_summary(ckpt) -> dict:
    c = ckpt.config
    digest = hashlib.sha256()
    for f in ckpt.files:
        digest.update(f.name.encode())
        digest.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(1 << 20))
    return {
        "path": str(ckpt.path),
        "model_type": c.family,
        "fingerprint": digest.hexdigest()[:16],
        "num_params": ckpt.num_params,
        "num_layers": c.num_layers,
        "num_experts": c.num_experts,
        "top_k": c.top_k,
        "hidden_size": c.hidden_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "dtype": str(ckpt.checkpoint_dtype).replace("torch.", ""),
        # the dtype attention projections and an untied LM head are held and streamed in (a bfloat16
        # checkpoint's stay bfloat16 on the CPU: engine/loader.py keeps_dense_in_checkpoint_dtype)
        "dense_dtype": str(ckpt.dense_dtype).replace("torch.", ""),
    }


def start_run(args: RunArgs, out: Path, run_id: str | None, resume: Path | None) -> None:
    """Check the run's arguments, claim its folder (or take the one to resume), measure, and write it."""
    from moebench.engine import RuntimeConfig

    manifest = read_manifest(resume) if resume is not None else None
    check_sampling_options(args.temperature, args.top_p, args.top_k)
    if run_id is not None and (not run_id or run_id in (".", "..") or "/" in run_id or os.sep in run_id):
        raise MoebenchError(f"--run-id '{run_id}': expected a plain folder name")

    http = args.engine != "bundled"
    if not http:  # fail on a bad switch before claiming a folder or loading anything
        from moebench.engine.overrides import Overrides

        # the overrides, read once here; a resumed run keeps the ones its manifest recorded
        recorded = ((manifest or {}).get("runtime") or {}).get("overrides")
        overrides = Overrides(**recorded) if recorded else Overrides.from_environment(os.environ)
        configs = _configs(args)
        threads = args.threads
        budget = _budget_text(args)
        from moebench.engine.store.factory import resolve_tier  # (torch) only once the switches are valid

        base_runtime = RuntimeConfig(
            device=args.device, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
            admission=args.admission, expert_budget=_parse_budget(budget),
            offload_tier=resolve_tier(args.offload_tier, args.device),
            decode_path=_run_decode_path(args),
            # with --ablate the speculative axis's points set it themselves (ablation.runtime_for)
            speculative="off" if args.ablate else args.speculative, spec_tokens=args.spec_tokens,
            spec_max_batch=args.spec_max_batch, overrides=overrides,
        )
        base_runtime = _one_tier_for_every_config(base_runtime, configs)
        _check_decode_paths(args, base_runtime, configs)
        from moebench.engine.weight_evidence import activations_refusal

        refusal = activations_refusal(overrides.activations, [_runtime_for(base_runtime, c) for c in configs])
        if refusal:
            raise MoebenchError(refusal)

    # The run's folder is claimed before any work, so an unwritable --out or a taken --run-id is
    # one line now, not a traceback after the model loaded, and two runs never share a folder.
    if resume is not None:
        run_dir, claimed = Path(resume), False
        ensure_writable_dir(run_dir, "--resume")
    else:
        run_dir, claimed = _claim_run_dir(Path(out), run_id, args), True
        manifest = None
    lock = _lock_run(run_dir)
    try:
        if resume is not None:
            _drop_torn_tails(run_dir)
        if http:
            _run_over_http(args, run_dir, manifest)
        else:
            _run_bundled(args, run_dir, manifest, configs, threads, base_runtime)
    except BaseException as e:
        started = (run_dir / "manifest.json").exists()
        trials = run_dir / "trials.jsonl"
        measured = trials.exists() and trials.stat().st_size > 0
        if claimed and not measured and (not started or isinstance(e, MoebenchError)):
            # refused (a budget the store cannot hold, say) or stopped before the manifest: nothing to
            # keep or resume. A stop after the manifest keeps the folder: the message printed with it
            # says `--resume DIR`, and the samples so far are the user's to read.
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt) and started:  # at any point after the manifest: how to go on
            print(f"interrupted: {kept_trials_note(run_dir, _total_trials(run_dir))}; "
                  f"continue with: moebench run --resume {shlex.quote(str(run_dir))}", file=sys.stderr, flush=True)
        if isinstance(e, OSError) and started:  # e.g. the disk filled up: what is kept, how to go on
            raise MoebenchError(f"{describe_os_error(e)}; {kept_trials_note(run_dir, _total_trials(run_dir))}; "
                                f"then continue with: moebench run --resume {shlex.quote(str(run_dir))}") from None
        raise
    finally:
        os.close(lock)
    _print_next_steps(run_dir)


def _run_decode_path(args: RunArgs) -> str:
    """The decode path of every config that does not set its own: --decode-path, except in a run
    that ablates it, whose native point sets native itself (the others run auto)."""
    path = args.decode_path or "auto"  # (a manifest from before the option: auto)
    return "auto" if path == "native" and args.ablate else path


def _check_decode_paths(args: RunArgs, base_runtime, configs) -> None:
    """Each config's runtime, and its decode path against the model's config.json, before anything
    loads: a path the model or the config cannot run is one line (engine/decode_path.py says why)."""
    from moebench.engine.decode_path import path_refusal
    from moebench.engine.families import parse_model_config

    runtimes = [(cfg, _runtime_for(base_runtime, cfg)) for cfg in configs]
    model_path = Path(args.model) if args.model else bundled_model_path(args.suite)
    if not (model_path / "config.json").is_file():
        return  # the loader, later, says what is wrong with the path
    model_cfg = parse_model_config(model_path / "config.json")
    for cfg, runtime in runtimes:
        refusal = path_refusal(runtime.decode_path, model_cfg, runtime)
        if refusal:
            raise MoebenchError(refusal if len(configs) == 1 else f"config '{cfg.name}': {refusal}")


def _one_tier_for_every_config(base_runtime, configs):
    """--weights int8's experts exist only in memory, so a disk tier cannot hold them and its configs
    offload to host memory instead: the whole run then does, so the weights switch changes only the
    weights' precision (not the tier its speedup is measured against)."""
    from dataclasses import replace

    in_memory_only = [c.name for c in configs if c.weights != FULL_WEIGHTS]
    if base_runtime.offload_tier != "disk" or not in_memory_only:
        return base_runtime
    print(f"moebench: offload tier host for every config, not disk: {', '.join(in_memory_only)} "
          f"hold {'/'.join(sorted({c.weights for c in configs if c.weights != FULL_WEIGHTS}))} experts that exist "
          "only in memory", file=sys.stderr, flush=True)
    return replace(base_runtime, offload_tier="host")


def _claim_run_dir(out: Path, run_id: str | None, args: RunArgs) -> Path:
    """Create the run's folder exclusively (mkdir fails if it exists): two runs started at the same
    moment get two folders, and a --run-id that exists is refused instead of merged into."""
    ensure_writable_dir(out, "--out")
    for _ in range(8):
        run_dir = out / (run_id or _default_run_id(args))
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            if run_id is not None:
                raise MoebenchError(_taken(run_dir)) from None
        except OSError as e:
            raise MoebenchError(f"--out {out}: cannot create {run_dir.name} there ({e.strerror or e})") from None
    raise MoebenchError(f"--out {out}: could not find a free run id")


def _taken(run_dir: Path) -> str:
    return (f"{run_dir}: already exists (choose another --run-id, or continue that run "
            f"with --resume {shlex.quote(str(run_dir))})")


def _lock_run(run_dir: Path) -> int:
    """Hold an exclusive lock on the run's folder while writing it; the OS releases it when the
    process ends in any way, kill -9 included. A second writer (two --resume at once) is refused."""
    import fcntl

    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MoebenchError(f"{run_dir}: another moebench process is writing this run now; "
                            "wait for it to finish or stop it first") from None
    return fd


def _drop_torn_tails(run_dir: Path) -> None:
    for name in ("trials.jsonl", "samples.jsonl"):
        f = run_dir / name
        if f.exists():
            dropped = drop_torn_tail(f)
            if dropped:
                print(f"moebench: warning: {f}: dropped a torn last line ({dropped} bytes) left by an "
                      "interrupted write; its trial is redone", file=sys.stderr)


def kept_trials_note(run_dir: Path, total: int | None = None) -> str:
    """How much of an interrupted run is kept: only complete trials count (resume redoes the rest)."""
    from moebench.measuring.samples import trial_key

    try:
        done = {trial_key(r) for r in read_jsonl(run_dir / "trials.jsonl")} \
            if (run_dir / "trials.jsonl").exists() else set()
        partial = [r for r in read_jsonl(run_dir / "samples.jsonl") if trial_key(r) not in done] \
            if (run_dir / "samples.jsonl").exists() else []
    except (MoebenchError, OSError, KeyError):
        return f"the complete trials so far are kept in {run_dir}"
    of = f" of {total}" if total else ""
    note = f"{len(done)}{of} trials complete and kept in {run_dir}"
    if partial:
        note += f" (the {len(partial)} samples of the unfinished trial are redone on resume)"
    return note


def _total_trials(run_dir: Path) -> int | None:
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        return int(manifest["repeats"]) * len(manifest["configs"]) * len(manifest.get("loads") or [None])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _print_next_steps(run_dir: Path) -> None:
    where = shlex.quote(str(run_dir))
    print(f"next: moebench report {where}\n      moebench gate {where}", flush=True)


def _load_run_suite(args: RunArgs):
    from moebench.suites import load_suite

    return load_suite(args.suite, Path(args.data) if args.data else None, args.limit,
                      num_fewshot=args.num_fewshot)


def _fitting_suite(args: RunArgs):
    """The run's suite, refused when its longest prompt plus --max-new-tokens exceeds the model's
    context: past it the model writes garbage that would score as wrong answers (exit 0)."""
    from moebench.context_fit import check_suite_fits, run_hint, tokenizer_encoder
    from moebench.engine.families import parse_model_config
    from moebench.engine.loader import load_tokenizer

    suite_obj = _load_run_suite(args)
    model_path = Path(args.model) if args.model else bundled_model_path(args.suite)
    if not model_path.is_dir():
        return suite_obj  # the loader, next, says what is wrong with the path
    context = parse_model_config(model_path / "config.json").max_position_embeddings
    check_suite_fits(suite_obj, tokenizer_encoder(load_tokenizer(model_path)), args.max_new_tokens, context,
                     model_path.name, run_hint(suite_obj))
    return suite_obj


def _run_bundled(args: RunArgs, run_dir: Path, manifest: dict | None, configs, threads, base_runtime) -> None:
    # before the model loads: a refusal here removes the folder just claimed (nothing ran in it)
    suite_obj = _fitting_suite(args)
    if threads:
        import torch

        torch.set_num_threads(threads)
    model_path = Path(args.model) if args.model else bundled_model_path(args.suite)
    from moebench.engine.overrides import apply_process_overrides

    apply_process_overrides(base_runtime.overrides, extension=base_runtime.device == "cpu")  # before the weights load
    ckpt, tokenizer = _load_model(model_path, base_runtime)

    if manifest is None:
        manifest = _manifest(args, run_dir, ckpt, suite_obj, configs, base_runtime)
        atomic_write_json(run_dir / "manifest.json", manifest)
    from moebench.measuring.measure import measure

    measure(run_dir, manifest, configs, ckpt, tokenizer, suite_obj, base_runtime, args)


def _run_over_http(args: RunArgs, run_dir: Path, manifest: dict | None) -> None:
    """The same measurement, statistics and files, with an OpenAI-compatible server as the engine."""
    from moebench.backends.http import HttpBackend
    from moebench.backends.openai import ClientOptions
    from moebench.backends.profiles import load_profiles
    from moebench.backends.server import Placeholders
    from moebench.measuring.measure import _requests, measure
    from moebench.suites import load_suite

    if (args.base_url is None) == (args.profiles is None):
        raise MoebenchError("--engine openai needs exactly one of --base-url URL or --profiles FILE")
    if args.concurrency < 1:
        raise MoebenchError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.temperature < 0:
        raise MoebenchError(f"--temperature must be >= 0, got {args.temperature}")
    for switch in SWITCHES:
        if getattr(args, switch) != OFF[switch]:
            raise MoebenchError(f"--{switch} is a switch of the bundled runtime; a server's configurations come from --profiles")
    if args.lm_head or args.axes or args.weights != "f32":
        raise MoebenchError("--lm-head, --weights and --axes are for the bundled runtime; a server's configurations "
                            "come from --profiles")
    if args.negative_control:
        raise MoebenchError("--negative-control is for the bundled runtime; mark a profile approximate = true instead")
    if args.speculative != "off":
        raise MoebenchError("--speculative is for the bundled runtime; a server's speculative settings come from --profiles")
    profile_file = load_profiles(Path(args.profiles)) if args.profiles else None
    if profile_file is not None and args.profile:
        profile_file.select([profile_file.profiles[0].name, *args.profile])
    suite_obj = load_suite(args.suite, Path(args.data) if args.data else None, args.limit,
                           num_fewshot=args.num_fewshot)
    placeholders = Placeholders("127.0.0.1", args.model, args.served_model, args.threads)
    tokenizer_dir = args.tokenizer or (profile_file.server.get("tokenizer") if profile_file else None)
    tokenizer = None
    if tokenizer_dir:
        from tokenizers import Tokenizer

        path = Path(placeholders.fill(tokenizer_dir)) / "tokenizer.json"
        if not path.is_file():
            raise MoebenchError(f"{path}: no such file (--tokenizer wants a directory with tokenizer.json)")
        tokenizer = Tokenizer.from_file(str(path))
    options = ClientOptions(concurrency=args.concurrency, chat=args.chat, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            request_timeout_s=args.request_timeout)
    warmup = _requests(suite_obj, suite_obj.items[: max(args.warmup, 0)], args.max_new_tokens)
    backend = HttpBackend(options, run_dir, profile_file, args.base_url, args.served_model, tokenizer,
                          placeholders, warmup)
    if manifest is None:
        manifest = _http_manifest(args, run_dir, suite_obj, backend)
        atomic_write_json(run_dir / "manifest.json", manifest)
    measure(run_dir, manifest, backend.configs, None, None, suite_obj, None, args, backend=backend)


def _http_manifest(args, run_dir, suite_obj, backend) -> dict:
    return _manifest_of(
        args, run_dir, suite_obj, backend.configs,
        model={"served_model": backend.served_model, "path": args.model},
        runtime={"engine": "openai", "max_new_tokens": args.max_new_tokens,
                 "concurrency": args.concurrency, "temperature": args.temperature,
                 "sampling": _sampling_record(args, over_http=True)},
        engine=backend.describe())


def _configs(args: RunArgs) -> list[ConfigPoint]:
    configs = _exact_configs(args)
    if args.ablate and "prefetch" in {c.name for c in configs} and _parse_budget(_budget_text(args)) not in (1, 1.0):
        # offloaded: the all-resident point too, for the memory / speed trade-off (docs/prefetch.md)
        configs.append(resident_reference())
    if args.negative_control:
        from moebench.engine.quantize import SCHEMES

        if args.negative_control not in SCHEMES:
            raise MoebenchError(f"--negative-control: unknown scheme '{args.negative_control}' (choose from: {', '.join(SCHEMES)})")
        if configs[0].name != "baseline":
            raise MoebenchError("--negative-control needs the baseline in the run (use --ablate)")
        configs.append(negative_control(args.negative_control))
    return configs


def _exact_configs(args: RunArgs) -> list[ConfigPoint]:
    for switch in SWITCHES:
        if getattr(args, switch) not in IMPLEMENTED[switch]:
            raise MoebenchError(f"unknown {switch} '{getattr(args, switch)}' (choose from: {', '.join(IMPLEMENTED[switch])})")
    method = args.speculative
    # --ablate takes several LM-head precisions (--lm-head int8,fp8); a single config takes one
    named_heads = tuple((args.lm_head or "f32").split(","))
    for head in named_heads:
        if head not in LM_HEADS:
            raise MoebenchError(f"--lm-head '{head}': choose from {', '.join(LM_HEADS)}")
    if len(named_heads) > 1 and (not args.ablate or "f32" in named_heads):
        raise MoebenchError(f"--lm-head {','.join(named_heads)}: several precisions need --ablate, none of them f32")
    head = named_heads[0] if len(named_heads) == 1 else ",".join(named_heads)
    weights = args.weights or "f32"  # (a manifest from before the option: f32)
    if weights not in WEIGHT_PRECISIONS:
        raise MoebenchError(f"--weights '{weights}': choose from {', '.join(WEIGHT_PRECISIONS)}")
    if args.ablate:
        switches, others = parse_axes(args.axes)
        spec_axis, head_axis = SPECULATIVE_AXIS in others, LM_HEAD_AXIS in others
        if method != "off" and not spec_axis:
            raise MoebenchError(f"--speculative {method} with --ablate: add speculative to --axes (the run then ablates {method})")
        if head != "f32" and not head_axis:
            raise MoebenchError(f"--lm-head {head} with --ablate: add lm-head to --axes (the run then ablates {head})")
        heads = (named_heads if head != "f32" else LOW_PRECISION_HEADS) if head_axis else ()
        if weights != "f32" and WEIGHTS_AXIS not in others:
            raise MoebenchError(f"--weights {weights} with --ablate: add weights to --axes (the run then ablates {weights})")
        precisions = ((weights,) if weights != "f32" else LOW_PRECISION_WEIGHTS) if WEIGHTS_AXIS in others else ()
        path, path_axis = args.decode_path or "auto", DECODE_PATH_AXIS in others
        if path == "native" and not path_axis:
            raise MoebenchError("--decode-path native with --ablate: add decode-path to --axes (the run then compares "
                                "native with the chained path on the fused kernel)")
        if path_axis and path not in ("auto", "chained", "native"):
            raise MoebenchError(f"--axes decode-path compares native with the chained path: --decode-path {path} "
                                "cannot be its reference")
        stacked = bool(args.approximate_stacked)  # (a manifest from before the option: False)
        if stacked and not (switches and (heads or precisions)):
            raise MoebenchError("--approximate-stacked needs a switch and lm-head or weights in --axes")
        return ablation_matrix(switches, factorial=args.factorial, approximate_stacked=stacked,
                               speculative=(method if method != "off" else "ngram") if spec_axis else None,
                               lm_heads=heads, weights=precisions, decode_paths=path_axis)
    if args.axes:
        raise MoebenchError("--axes needs --ablate")
    if args.approximate_stacked:
        raise MoebenchError("--approximate-stacked needs --ablate")
    return [point(args.kernel, args.scheduler, args.prefetch, lm_head=head, weights=weights)]


def _load_model(path: Path, runtime):
    from moebench.engine import load_checkpoint
    from moebench.engine.loader import load_tokenizer

    if runtime.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise MoebenchError("--device cuda: no CUDA device is available")
    # below a full budget, or on the CPU, the experts stay in the file's dtype: the store holds them so
    # where the kernels widen them (stores.expert_store_dtype), else converts only those it
    # holds; with the disk tier they stay in the files (no copy in memory)
    offloading = runtime.expert_budget not in (1, 1.0)
    ckpt = load_checkpoint(path, device=runtime.device, dtype=runtime.torch_dtype,
                           experts_in_checkpoint_dtype=offloading or runtime.device == "cpu",
                           load_experts=not (offloading and runtime.offload_tier == "disk"), overrides=runtime.overrides)
    return ckpt, load_tokenizer(path)


def _default_run_id(args: RunArgs) -> str:
    """Time to the millisecond plus a random suffix: unique even for runs started together."""
    now = dt.datetime.now()
    if args.engine != "bundled":
        what = Path(args.profiles).stem if args.profiles else "server"
    else:
        what = Path(args.model).name if args.model else bundled_model_path(args.suite).name
    return f"{now:%Y%m%d-%H%M%S}-{now.microsecond // 1000:03d}-{secrets.token_hex(2)}-{what}-{args.suite}"


def _manifest(args, run_dir, ckpt, suite_obj, configs, runtime) -> dict:
    from moebench.engine.memory import huge_page_bytes
    from moebench.engine.store.tiers import disk_read_mode
    from moebench.kernels import fused_backend
    from dataclasses import replace

    from moebench.engine.speculative import spec_settings

    axis = [c.speculative for c in configs if getattr(c, "speculative", None)]
    from moebench.kernels.cpu_attention import decode_attention_backend

    return _manifest_of(args, run_dir, suite_obj, configs, model=_model_summary(ckpt), runtime={
        "device": runtime.device, "dtype": str(runtime.torch_dtype).replace("torch.", ""),
        "batch_size": runtime.batch_size, "max_new_tokens": runtime.max_new_tokens,
        "expert_budget": runtime.expert_budget, "offload_tier": runtime.offload_tier,
        # how the disk tier bypasses the page cache (O_DIRECT, or fadvise-evict where refused)
        "disk_read_mode": disk_read_mode(ckpt) if runtime.offload_tier == "disk" else None,
        "admission": runtime.admission, "kv_block_size": runtime.kv_block_size, "decode_path": runtime.decode_path,
        # evidence that weights and KV cache landed in huge pages (engine/memory.py)
        "huge_page_bytes": huge_page_bytes(),
        # which implementations run (a compiled kernel, or the torch fallback)
        "fused_moe_backend": fused_backend(runtime.device),
        "decode_attention": decode_attention_backend(runtime.device, runtime.torch_dtype, runtime.overrides.attention),
        # every override (engine/overrides.py), read once when the run started; a resume keeps them
        "overrides": runtime.overrides.to_dict(),
        "sampling": _sampling_record(args),
        # the run's speculative decoding, or the speculative axis's (its configs name their method)
        "speculative": {**spec_settings(replace(runtime, speculative=axis[0]) if axis else runtime).to_dict(),
                        **({"axis_configs": [c.name for c in configs if c.speculative]} if axis else {})},
    })


def _sampling_record(args: RunArgs, over_http: bool = False) -> dict:
    """How tokens were chosen and each request's seed made (the engine's evidence shows it drew)."""
    from moebench.engine.sampling import GREEDY, describe_sampling
    from moebench.measuring.measure import run_sampling

    record = describe_sampling(run_sampling(args) or GREEDY)
    if over_http and "sampler" in record:  # the server samples; moebench only sends each request's seed
        record["sampler"] = "the server's own (each request's seed in OpenAI's seed field)"
    return record


def _load_record(args, suite_obj) -> dict:
    """The offered loads and each one's arrival times, as every trial sends them; nothing for the closed loop."""
    loads = args.loads()
    if loads is None:
        return {}
    n = len(suite_obj.items)
    return {"loads": [{**ld.to_dict(), "arrivals_s": None if ld.closed else
                       ld.offsets(n, args.seed)} for ld in loads],
            "primary_load": primary_load(loads).label, "slo": args.slos()}


def primary_load(loads):
    """The load whose trials the accuracy verdict and the speedups are judged on: the closed loop where
    the sweep has it (the answers and the throughput of today's runs), else the first."""
    return next((ld for ld in loads if ld.closed), loads[0])


def _manifest_of(args, run_dir, suite_obj, configs, model: dict, runtime: dict, **extra) -> dict:
    """manifest.json: what ran, on what, from which command, code and packages."""
    from moebench.measuring.machine import describe_machine, git_commit, package_versions

    return {
        "schema": "moebench.manifest/1",
        "run_id": run_dir.name,
        "command": "moebench " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "args": args.to_dict(),
        "model": model,
        **extra,
        "suite": suite_obj.describe(),
        "configs": [c.to_dict() for c in configs],
        "baseline": configs[0].name,
        "runtime": runtime,
        "repeats": args.repeats,
        **_load_record(args, suite_obj),
        "warmup_items": args.warmup,
        "seed": args.seed,
        "git_commit": git_commit(),
        "versions": package_versions(),
        "machine": describe_machine(),
    }


def read_manifest(run_dir: Path) -> dict:
    f = run_dir / "manifest.json"
    if not f.exists():
        raise MoebenchError(f"{f}: no such file (not a moebench run directory)")
    try:
        manifest = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise MoebenchError(f"{f}: malformed JSON ({e.msg})") from None
    if manifest.get("schema") != "moebench.manifest/1" or "args" not in manifest:
        raise MoebenchError(f"{f}: not a moebench.manifest/1 file")
    return manifest
