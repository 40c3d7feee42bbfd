"""Ling-3.0 (`bailing_hybrid`) in the bundled runtime against `transformers` on tiny random checkpoints:
prefill logits within 1e-4 and 32 greedy tokens identical, at batch 1 and 3 with different prompt
lengths, with kernel naive and fused, scheduler static and continuous (mid-flight admission and
preemption included), over shapes that vary the layer pattern, the expert groups and q_lora_rank."""

import json

import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.config import StoreTuning
from moebench.engine.bailing_hybrid import HybridTransformer, make_hybrid_cache
from moebench.engine.kda import delta_rule_chunked, delta_rule_step
from moebench.engine.store.expert_store import NoPrefetch, ResidentStore
from moebench.engine.kv_cache import OutOfBlocks
from moebench.engine.model import build_forward_batch
from moebench.engine.moe import MoeBlock, make_kernel
from moebench.engine.moe import RoutingStats
from moebench.errors import MoebenchError
from benchmark_scripts import load_benchmark
from tiny_bailing import SHAPES, add_mtp_layer, make_tiny_bailing

PROMPT_LENGTHS = (5, 11, 37)  # the longest spans two prefill chunks of the KDA recurrence
NEW_TOKENS = 32


def prompts(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=list(SHAPES))
def tiny(request, tmp_path_factory):
    """(checkpoint path, loaded checkpoint, prompts, transformers' prefill logits and greedy tokens per prompt)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_bailing(tmp_path_factory.mktemp(request.param), request.param)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ckpt = load_checkpoint(path)
    ids_list = prompts(ckpt.config.vocab_size)
    logits, greedy = [], []
    with torch.no_grad():
        for ids in ids_list:
            logits.append(reference(torch.tensor([ids])).logits[0].float())
            out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     pad_token_id=0)
            greedy.append(out[0, len(ids):].tolist())
    return path, ckpt, ids_list, logits, greedy


def engine_prefill_logits(ckpt, ids_list, kernel):
    cfg = ckpt.config
    block_manager, cache = make_hybrid_cache(ckpt, 64, 8, 4, torch.float32, "cpu")
    tables = []
    for ids in ids_list:
        table = []
        block_manager.ensure_capacity(table, len(ids))
        tables.append(table)
    model = HybridTransformer(ckpt, None)
    kernel_impl = make_kernel(kernel)
    model.moe_block = MoeBlock(model.route, kernel_impl, ResidentStore(ckpt), NoPrefetch(),
                               RoutingStats(cfg.num_layers, cfg.num_experts))
    batch = build_forward_batch(ids_list, [0] * len(ids_list), tables, 8, "cpu")
    return model.forward(batch, cache, all_positions=True), kernel_impl


@pytest.mark.parametrize("kernel", ["naive", "fused"])
@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_logits_match_transformers(tiny, batch, kernel):
    _, ckpt, ids_list, ref_logits, _ = tiny
    ours, kernel_impl = engine_prefill_logits(ckpt, ids_list[:batch], kernel)
    assert kernel_impl.calls > 0
    offset = 0
    for ids, ref in zip(ids_list[:batch], ref_logits):
        got = ours[offset: offset + len(ids)]
        offset += len(ids)
        assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
@pytest.mark.parametrize("kernel", ["naive", "fused"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_match_transformers(tiny, batch, kernel, scheduler):
    _, ckpt, ids_list, _, greedy = tiny
    runtime = RuntimeConfig(batch_size=batch, max_new_tokens=NEW_TOKENS, kernel=kernel, scheduler=scheduler)
    result = Engine(ckpt, None, runtime).generate([Request(f"r{i}", "") for i in range(batch)],
                                                  prompt_ids=ids_list[:batch])
    assert [c.output_ids for c in result.completions] == greedy[:batch]
    assert all(c.finish_reason == "length" for c in result.completions)
    assert not result.activation_errors, result.activation_errors
    if kernel == "fused":  # the fused kernel computed every MoE call, with the grouped router's weights and ids
        ev = result.evidence["kernel"]
        assert ev["fused_calls"] > 0 and ev.get("naive_calls", 0) == 0


def test_continuous_batching_admits_mid_flight_and_preempts_with_recurrent_state(tiny, monkeypatch):
    """Three requests through two slots: one finishes early and the third joins the running batch;
    then, with too few KV blocks, a running request is preempted, its state slot freed, and it is
    recomputed from its prompt. Every output is still transformers' greedy output."""
    _, ckpt, ids_list, _, greedy = tiny
    lengths = [NEW_TOKENS, 6, NEW_TOKENS]
    requests = [Request(f"r{i}", "", n) for i, n in enumerate(lengths)]
    expected = [g[:n] for g, n in zip(greedy, lengths)]

    runtime = RuntimeConfig(batch_size=2, scheduler="continuous", admission="fifo", max_new_tokens=NEW_TOKENS)
    result = Engine(ckpt, None, runtime).generate(requests, prompt_ids=ids_list)
    assert [c.output_ids for c in result.completions] == expected
    assert result.evidence["scheduler"]["admissions_mid_flight"] > 0
    assert not result.activation_errors

    # 4-token blocks: the longest request needs 18 of them; 24 make two running requests collide
    monkeypatch.setattr(Engine, "_kv_blocks", lambda self, seqs: 24)
    runtime = RuntimeConfig(batch_size=2, scheduler="continuous", admission="fifo", max_new_tokens=NEW_TOKENS,
                            kv_block_size=4)
    result = Engine(ckpt, None, runtime).generate(requests, prompt_ids=ids_list)
    assert [c.output_ids for c in result.completions] == expected
    ev = result.evidence["scheduler"]
    assert ev["preemptions"] > 0 and ev["readmissions"] == ev["preemptions"]


def test_state_slots_follow_the_block_tables(tiny):
    _, ckpt, _, _, _ = tiny
    block_manager, cache = make_hybrid_cache(ckpt, 8, 4, 2, torch.float32, "cpu")
    a, b, c = [], [], []
    block_manager.ensure_capacity(a, 5)
    block_manager.ensure_capacity(b, 3)
    assert sorted(block_manager.state_slots(torch.tensor([a[0], b[0]])).tolist()) == [0, 1]
    assert not block_manager.can_fit(c, 2)  # blocks are free, state slots are not
    with pytest.raises(OutOfBlocks):
        block_manager.ensure_capacity(c, 2)
    slot_b = int(block_manager.state_slots(torch.tensor([b[0]])))
    block_manager.free(b)
    block_manager.ensure_capacity(c, 2)
    assert int(block_manager.state_slots(torch.tensor([c[0]]))) == slot_b
    stale = list(a)
    block_manager.free(a)
    with pytest.raises(ValueError):
        block_manager.free(stale)  # a double free is caught before a slot is given back twice
    assert len(block_manager.free_state_slots) == 1
    if ckpt.config.kda_layers:  # the state a request holds does not grow with its length
        per_request = cache.state_bytes_per_request()
        assert per_request > 0 and per_request == make_hybrid_cache(ckpt, 64, 4, 2, torch.float32, "cpu")[1] \
            .state_bytes_per_request()
        # the roofline counts exactly that state per sequence, plus the MLA latents per context token
        from moebench.engine.families import cache_bytes_per_step

        assert cache_bytes_per_step(ckpt.config, 0, 3, 4) == 3 * per_request
        assert cache_bytes_per_step(ckpt.config, 10, 3, 4) - 3 * per_request == 10 * cache.latent_bytes_per_token()


@pytest.mark.parametrize("max_decay", [2.0, 30.0])  # chunks within FACTORED_SPAN, and beyond it
def test_chunked_prefill_recurrence_equals_token_by_token(max_decay):
    g = torch.Generator().manual_seed(3)
    T, h, dk, dv = 45, 2, 5, 3
    q, k = (torch.nn.functional.normalize(torch.randn(T, h, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(T, h, dv, generator=g)
    log_decay = -max_decay * torch.rand(T, h, dk, generator=g)
    beta = torch.rand(T, h, generator=g)
    start = torch.randn(h, dk, dv, generator=g)
    out, final = delta_rule_chunked(q, k, v, log_decay, beta, start.clone(), chunk=16)
    state = start.clone()[None]
    for t in range(T):
        step = delta_rule_step(q[t][None], k[t][None], v[t][None], log_decay[t][None], beta[t][None], state)
        assert torch.allclose(out[t], step[0], atol=1e-5)
    assert torch.allclose(final, state[0], atol=1e-5)


def test_mtp_layers_in_the_checkpoint_are_loaded_past(tmp_path):
    path = make_tiny_bailing(tmp_path / "mtp", "g2_ngroup2_topk1")
    plain = load_checkpoint(path)
    add_mtp_layer(path)
    with_mtp = load_checkpoint(path)
    assert with_mtp.config.num_mtp_layers == 1 and len(with_mtp.layers) == plain.config.num_layers
    ids = prompts(plain.config.vocab_size)[:1]
    outputs = [Engine(c, None, RuntimeConfig(batch_size=1, max_new_tokens=4)).generate(
        [Request("r", "")], prompt_ids=ids).completions[0].output_ids for c in (plain, with_mtp)]
    assert outputs[0] == outputs[1]


def test_bad_configs_are_one_line_errors(tmp_path):
    path = make_tiny_bailing(tmp_path / "bad", "g2_ngroup2_topk1")
    config = json.loads((path / "config.json").read_text())
    for change, message in ((dict(num_expert_group=3), "do not split into n_group=3"),
                            (dict(topk_group=5), "is not possible"),
                            (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
                            (dict(kv_lora_rank=13), r"model.safetensors: tensor '.*kv_a_proj_with_mqa.weight' has shape")):
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(MoebenchError, match=message):
            load_checkpoint(path)


@pytest.mark.parametrize("kernel", ["naive", "fused"])
def test_expert_offload_with_lookahead_from_the_grouped_router(tiny, kernel):
    """Half the experts resident, the rest loaded from host memory on demand or predicted a layer
    ahead by lookahead (its guess ranks the next layer's router logits): outputs stay transformers'
    greedy ones, and the prefetches are used."""
    _, ckpt, ids_list, _, greedy = tiny
    cfg = ckpt.config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    if moe_layers * (cfg.num_experts // 2) < cfg.num_experts:
        pytest.skip("half the experts of every MoE layer do not hold one layer's all (a prefill may need them): "
                    "the store refuses this budget")
    requests = [Request(f"r{i}", "") for i in range(3)]
    runtime = RuntimeConfig(batch_size=3, max_new_tokens=NEW_TOKENS, kernel=kernel, expert_budget=0.5,
                            offload_tier="host", prefetch="lookahead")
    result = Engine(ckpt, None, runtime).generate(requests, prompt_ids=ids_list)
    assert [c.output_ids for c in result.completions] == greedy
    assert not result.activation_errors, result.activation_errors
    ev = result.evidence["prefetch"]
    assert ev["store"] in ("pooled", "pooled-native") and ev["expert_misses"] > 0 and ev["prefetch_hits"] > 0
    assert ev["lookahead_router"] == "grouped sigmoid (bias, groups)"


def test_lookahead_guesses_with_the_expert_bias_and_groups(tmp_path, monkeypatch):
    """Where the expert bias moves choices, guessing by the grouped router itself misses far less
    than ranking raw router logits (measured: 23 vs 78 misses here), and loads less."""
    from moebench.engine.store.prefetch import GroupedRouterGuess

    ckpt = load_checkpoint(make_tiny_bailing(tmp_path / "bias", "g3_ngroup4_topk2_qlora", expert_bias_scale=0.5))
    ids_list = prompts(ckpt.config.vocab_size)
    # the governor off: it would skip guessing in alternate windows, and this compares the guesses
    runtime = RuntimeConfig(batch_size=3, max_new_tokens=NEW_TOKENS, kernel="fused", expert_budget=0.5,
                            offload_tier="host", prefetch="lookahead", store=StoreTuning(lookahead_governor=False))

    def run():
        result = Engine(ckpt, None, runtime).generate([Request(f"r{i}", "") for i in range(3)], prompt_ids=ids_list)
        return [c.output_ids for c in result.completions], result.evidence["prefetch"]

    grouped_outputs, grouped = run()
    monkeypatch.setattr(GroupedRouterGuess, "applies", staticmethod(lambda ckpt: False))
    plain_outputs, plain = run()
    assert plain["lookahead_router"] == "top-k of router logits"
    assert grouped_outputs == plain_outputs
    assert grouped["expert_misses"] * 2 < plain["expert_misses"]
    assert grouped["prefetch_issued"] < plain["prefetch_issued"]


def test_ling3_flash_scaled_keeps_the_reference_structure(tmp_path):
    from moebench.engine.bailing_hybrid import parse_hybrid_config
    from moebench.models.synth import LING3_FLASH, SHAPES

    scaled = SHAPES["ling3-flash-scaled"]["config"]
    for c in (scaled, LING3_FLASH):
        assert c["num_local_experts"] // c["num_experts_per_tok"] == 64
        assert (c["n_group"], c["topk_group"], c["layer_group_size"], c["n_shared_experts"]) == (8, 4, 6, 1)
        assert c["routed_scaling_factor"] == 2.5
    cfg = parse_hybrid_config({**scaled, "model_type": "bailing_hybrid", "vocab_size": 100}, tmp_path / "config.json")
    assert (len(cfg.kda_layers), len(cfg.mla_layers)) == (10, 2) and cfg.mla_layers == [5, 11]
    assert cfg.dense_layers == (0,)


def test_models_synth_writes_a_checkpoint_the_engine_runs_with_its_model_card(tmp_path, gsm8k_dir, monkeypatch,
                                                                              capsys):
    """The command's whole path on a narrow version of the shape (the real one takes a minute to write)."""
    from typer.testing import CliRunner

    from moebench.cli.app import app
    from moebench.models import synth as synth_models

    data = tmp_path / "data"
    data.mkdir()
    with (gsm8k_dir / "train.jsonl").open() as f:
        (data / "train.jsonl").write_text("".join(line for _, line in zip(range(200), f)))
    spec = synth_models.SHAPES["ling3-flash-scaled"]
    narrow = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=8)
    monkeypatch.setitem(synth_models.SHAPES, "ling3-flash-scaled", {**spec, "config": {**spec["config"], **narrow}})
    out = tmp_path / "model"
    runner = CliRunner()
    result = runner.invoke(app, ["models", "synth", "--out", str(out), "--data", str(data), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    card = json.loads((out / "model_card.json").read_text())
    assert card["synthetic"] and "route almost uniformly" in card["random_weights_note"]
    assert card["scale"]["num_local_experts"] == {"reference": 512, "this": 128}
    assert "route almost uniformly" in (out / "README.md").read_text()

    from moebench.engine.loader import load_tokenizer

    ckpt = load_checkpoint(out)
    assert ckpt.config.family == "bailing_hybrid" and len(ckpt.config.mla_layers) == 2
    tokenizer = load_tokenizer(out)
    completion = Engine(ckpt, tokenizer, RuntimeConfig(batch_size=1, max_new_tokens=4, kernel="fused")).generate(
        [Request("q", "Natalia sold clips to 48 of her friends in April.")]).completions[0]
    assert completion.output_tokens >= 1 and completion.prompt_tokens < 20  # BPE, not characters

    import sys

    from moebench.cli.app import main

    monkeypatch.setattr(sys, "argv", ["moebench", "models", "synth", "--shape", "ling9", "--out", str(tmp_path / "x"),
                                      "--data", str(data)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip().count("\n") == 0 and "unknown shape 'ling9'" in err


def decode_logits_with_slots(ckpt, ids_list, continuations, holes: bool):
    """Prefill, then decode `continuations` token by token; with `holes`, the sequences' state slots
    are out of order and not adjacent (other requests hold the slots in between)."""
    cfg = ckpt.config
    block_manager, cache = make_hybrid_cache(ckpt, 64, 8, 6, torch.float32, "cpu")
    if holes:  # slots 0..2 taken, then 1 and 0 freed: the sequences get 1, 0, 3
        others = [[] for _ in range(3)]
        for table in others:
            block_manager.ensure_capacity(table, 1)
        block_manager.free(others[1])
    tables = []
    for n, ids in enumerate(ids_list):
        if holes and n == 1:
            block_manager.free(others[0])
        table = []
        block_manager.ensure_capacity(table, len(ids) + len(continuations[n]))
        tables.append(table)
    slots = block_manager.state_slots(torch.tensor([t[0] for t in tables])).tolist()
    model = HybridTransformer(ckpt, None)
    model.moe_block = MoeBlock(model.route, make_kernel("naive"), ResidentStore(ckpt), NoPrefetch(),
                               RoutingStats(cfg.num_layers, cfg.num_experts))
    model.forward(build_forward_batch(ids_list, [0] * len(ids_list), tables, 8, "cpu"), cache)
    logits = []
    for step in range(len(continuations[0])):
        cached = [len(ids) + step for ids in ids_list]
        batch = build_forward_batch([[c[step]] for c in continuations], cached, tables, 8, "cpu")
        logits.append(model.forward(batch, cache))
    return slots, torch.stack(logits)


def test_decode_with_scattered_state_slots_equals_adjacent_ones(tiny):
    _, ckpt, ids_list, _, greedy = tiny
    if not ckpt.config.kda_layers:
        pytest.skip("no KDA layer: no state slots")
    continuations = [g[:4] for g in greedy]
    adjacent_slots, adjacent = decode_logits_with_slots(ckpt, ids_list, continuations, holes=False)
    scattered_slots, scattered = decode_logits_with_slots(ckpt, ids_list, continuations, holes=True)
    assert adjacent_slots == [0, 1, 2] and scattered_slots == [1, 0, 3]
    assert (adjacent - scattered).abs().max().item() <= 1e-5
    assert adjacent[:, :, :].argmax(-1).T.tolist() == [g[1:5] for g in greedy]


def test_gguf_export_refuses_the_family_in_one_line(tmp_path):
    from moebench.models.export_gguf import export_gguf

    path = make_tiny_bailing(tmp_path / "gguf", "g2_ngroup2_topk1")
    with pytest.raises(MoebenchError, match="model_type 'bailing_hybrid'.*does not support"):
        export_gguf(path, tmp_path / "out.gguf")


def test_bench_joins_per_request_transformers_caches_into_the_batched_generate(tiny):
    """bench_bailing's way to compare at long prompts: transformers prefills each prompt alone, the
    caches are joined into one left-padded batch cache, generate() decodes from it. Its tokens must be
    those of one batched generate() with the prompts left-padded, and the engine's greedy ones."""
    from transformers import AutoModelForCausalLM

    bench = load_benchmark("bench_bailing")
    path, _, ids_list, _, greedy = tiny
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batched = bench.hf_generate_batched(ref, ids_list, 12)
    for mode in ("recurrent", "chunk"):
        joined = bench.hf_join(ref, bench.hf_prefill_each(ref, ids_list, None, "", mode), ids_list)
        _, outputs, gaps = bench.hf_decode(ref, joined, 12, 0)
        assert outputs == batched, mode
        assert outputs == [g[:12] for g in greedy]
        assert len(gaps) == 11 and all(g >= 0 for step in gaps for g in step)


def test_memory_benchmark_sees_a_constant_kda_state_and_growing_latents(tmp_path):
    """bailing_memory's per-request accounting on a tiny checkpoint: the KDA state does not grow with
    the sequence, the MLA latents grow by whole KV blocks."""
    memory = load_benchmark("bailing_memory")
    path = make_tiny_bailing(tmp_path / "mem", "g2_ngroup2_topk1")
    short, long = (memory.measure_one(path, n, 4, "naive", 1) for n in (24, 96))
    assert short["kda_bytes"] == long["kda_bytes"] > 0
    per_token = short["mla_bytes_per_token"]
    assert per_token == 2 * (12 + 8) * 4  # 2 MLA layers x (kv_lora_rank + rope dims) x float32
    assert long["mla_bytes"] > short["mla_bytes"] and long["mla_bytes"] % (16 * per_token) == 0
