"""The engine against `transformers` on tiny random checkpoints of each family: prefill logits
within 1e-4, and 32 greedy tokens identical, at batch 1 and 3 with different prompt lengths."""

import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.kv_cache import BlockManager, KVCache
from moebench.engine.model import MoeTransformer, build_forward_batch
from moebench.engine.moe import MoeBlock, make_kernel
from moebench.engine.expert_store import NoPrefetch, ResidentStore
from moebench.engine.routing_stats import RoutingStats
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
