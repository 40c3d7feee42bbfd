"""The engine against `transformers` on tiny random checkpoints of each family: prefill logits
within 1e-4, and 32 greedy tokens identical, at batch 1 and 3 with different prompt lengths."""

import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.kv_cache import BlockManager, KVCache
from moebench.engine.model import MoeTransformer, build_forward_batch
from moebench.engine.moe import MoeBlock, make_kernel
from moebench.engine.store.expert_store import NoPrefetch, ResidentStore
from moebench.engine.moe import RoutingStats
from tiny_models import FAMILIES, make_tiny_checkpoint

PROMPT_LENGTHS = (5, 11, 17)


def prompts(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference


def engine_prefill_logits(ckpt, ids_list, kernel="naive"):
    cfg = ckpt.config
    bm = BlockManager(64, 8)
    kv = KVCache(cfg.num_layers, 64, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    tables = []
    for ids in ids_list:
        t = []
        bm.ensure_capacity(t, len(ids))
        tables.append(t)
    model = MoeTransformer(ckpt, None)
    stats = RoutingStats(cfg.num_layers, cfg.num_experts)
    model.moe_block = MoeBlock(model.route, make_kernel(kernel), ResidentStore(ckpt), NoPrefetch(), stats)
    batch = build_forward_batch(ids_list, [0] * len(ids_list), tables, 8, "cpu")
    return model.forward(batch, kv, all_positions=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_logits_match_transformers(checkpoint, batch):
    path, reference = checkpoint
    ckpt = load_checkpoint(path)
    ids_list = prompts(ckpt.config.vocab_size)[:batch]
    ours = engine_prefill_logits(ckpt, ids_list)
    offset = 0
    for ids in ids_list:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0].float()
        got = ours[offset: offset + len(ids)]
        offset += len(ids)
        assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_match_transformers(checkpoint, batch):
    path, reference = checkpoint
    ckpt = load_checkpoint(path)
    ids_list = prompts(ckpt.config.vocab_size)[:batch]
    engine = Engine(ckpt, None, RuntimeConfig(batch_size=batch, max_new_tokens=32))
    result = engine.generate([Request(f"r{i}", "") for i in range(batch)], prompt_ids=ids_list)
    for ids, completion in zip(ids_list, result.completions):
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        assert completion.output_ids == out[0, len(ids):].tolist()
        assert completion.finish_reason == "length"


# A bfloat16 checkpoint on the CPU: experts, attention projections and the LM head stay bfloat16
# (routers, norms and embeddings float32) and every decode path streams them, widened to float32 in
# registers. Widening is exact, so the engine must match transformers' float32 forward of the very
# same bfloat16 values, as it matches a float32 checkpoint.
BF16_PATHS = [("native", "fused"), ("chained", "fused"), ("chained", "naive")]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from moebench.kernels.cpu_dense import dense_kernel_enabled

    if not dense_kernel_enabled():
        pytest.skip("the C++ extension is not available here: a bfloat16 checkpoint's dense weights are widened at load")
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen3_e6_k2_norm", dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference


def test_bf16_checkpoint_keeps_its_dense_weights_bf16(bf16_checkpoint):
    ckpt = load_checkpoint(bf16_checkpoint[0], experts_in_checkpoint_dtype=True)
    assert ckpt.checkpoint_dtype == torch.bfloat16 and ckpt.dense_dtype == torch.bfloat16
    layer = ckpt.layers[0]
    assert {layer.qkv_proj.dtype, layer.o_proj.dtype, ckpt.lm_head.dtype, layer.w13.dtype} == {torch.bfloat16}
    assert {layer.router.dtype, layer.input_norm.dtype, ckpt.embed.dtype} == {torch.float32}


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("decode_path,kernel", BF16_PATHS)
def test_bf16_checkpoint_greedy_tokens_match_transformers_float32(bf16_checkpoint, batch, decode_path, kernel):
    from moebench.kernels.cpu_dense import dense_backends

    path, reference = bf16_checkpoint
    ckpt = load_checkpoint(path, experts_in_checkpoint_dtype=True)
    g = torch.Generator().manual_seed(batch)
    ids_list = [torch.randint(2, ckpt.config.vocab_size, (int(n),), generator=g).tolist()
                for n in torch.randint(3, 20, (batch,), generator=g)]
    engine = Engine(ckpt, None, RuntimeConfig(batch_size=batch, max_new_tokens=24, kernel=kernel,
                                              decode_path=decode_path))
    streamed = dense_backends().get("cpp-dense", 0)
    result = engine.generate([Request(f"r{i}", "") for i in range(batch)], prompt_ids=ids_list)
    assert result.evidence["decode_path"]["path"] == decode_path and not result.activation_errors
    ran = "native-layers" if decode_path == "native" else "layer-by-layer"
    assert set(result.evidence["decode_steps"]) == {ran}
    assert dense_backends().get("cpp-dense", 0) > streamed  # the bfloat16 projections ran in the kernel
    with torch.no_grad():
        for ids, completion in zip(ids_list, result.completions):
            out = reference.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
            assert completion.output_ids == out[0, len(ids):].tolist()


def test_bf16_prefill_logits_match_transformers_float32(bf16_checkpoint):
    path, reference = bf16_checkpoint
    ckpt = load_checkpoint(path)
    ids_list = prompts(ckpt.config.vocab_size)
    ours = engine_prefill_logits(ckpt, ids_list)
    offset = 0
    for ids in ids_list:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0].float()
        assert (ours[offset: offset + len(ids)] - ref).abs().max().item() <= 1e-4
        offset += len(ids)
