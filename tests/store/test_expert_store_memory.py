"""Expert memory is a result: the budget is every expert byte the store holds (no staging beside it),
the disk tier keeps no copy of the experts in memory, and a checkpoint loaded without its experts
still runs resident, quantized and offloaded, exactly."""

import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.store.factory import make_store_and_prefetcher, resolve_tier
from moebench.engine.quantize import quantize_experts
from moebench.errors import MoebenchError
from tiny_models import make_tiny_checkpoint

E, LAYERS = 16, 4


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen3_e6_k2_norm", dtype=torch.bfloat16,
                                num_experts=E, num_hidden_layers=LAYERS)


def generate(ckpt, **runtime):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, ckpt.config.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 17)]
    rt = RuntimeConfig(batch_size=len(ids), max_new_tokens=16, **runtime)
    return Engine(ckpt, None, rt).generate([Request(f"r{i}", "") for i in range(len(ids))], prompt_ids=ids)


def test_disk_tier_holds_no_copy_and_half_the_memory(path):
    full = load_checkpoint(path)
    resident = generate(full)
    bare = load_checkpoint(path, experts_in_checkpoint_dtype=True, load_experts=False)
    assert all(layer.w13 is None and layer.w2 is None for layer in bare.layers)
    assert bare.num_params == full.num_params  # the manifest counts the experts left in the files
    for prefetch in ("off", "lookahead"):
        result = generate(bare, expert_budget=0.5, offload_tier="disk", prefetch=prefetch)
        assert [c.output_ids for c in result.completions] == [c.output_ids for c in resident.completions]
        ev = result.evidence["prefetch"]
        assert ev["host_copy_bytes"] == 0
        # the budget plus one read buffer per reading thread, whatever the prefetch setting
        assert ev["expert_memory_bytes"] == ev["expert_pool_bytes"] + ev["read_buffer_bytes"]
        assert ev["expert_memory_bytes"] <= 0.55 * resident.evidence["prefetch"]["expert_memory_bytes"]
    # resident from a checkpoint without its experts: read from the files into the store's own buffers
    again = generate(bare)
    assert [c.output_ids for c in again.completions] == [c.output_ids for c in resident.completions]
    # (the float32-loaded checkpoint's experts are a copy beside the store's; the bare one holds none)
    assert again.evidence["prefetch"]["expert_memory_bytes"] == resident.evidence["prefetch"]["expert_pool_bytes"]


def test_host_tier_counts_its_copy(path):
    raw = load_checkpoint(path, experts_in_checkpoint_dtype=True)
    ev = generate(raw, expert_budget=0.5, offload_tier="host").evidence["prefetch"]
    every_expert_bf16 = LAYERS * E * raw.config.expert_param_count * 2
    assert ev["host_copy_bytes"] == every_expert_bf16 and ev["read_buffer_bytes"] == 0


def test_negative_control_of_experts_on_disk_is_quantized(path):
    """A quantized copy's experts exist only in memory: its store reads them from the host tier (said
    in the evidence), never the unquantized files, and matches the copy made from loaded experts."""
    bare = load_checkpoint(path, experts_in_checkpoint_dtype=True, load_experts=False)
    loaded = load_checkpoint(path, experts_in_checkpoint_dtype=True)
    q_bare, q_loaded = quantize_experts(bare, "int4"), quantize_experts(loaded, "int4")
    assert torch.equal(q_bare.layers[0].w13, q_loaded.layers[0].w13)
    store, _ = make_store_and_prefetcher(q_bare, RuntimeConfig(expert_budget=0.5, offload_tier="disk"))
    ev = store.evidence()
    store.close()
    assert ev["tier"] == "host" and "exist only in memory" in ev["tier_substituted"]
    a = generate(q_bare, expert_budget=0.5, offload_tier="disk")
    b = generate(q_loaded, expert_budget=1.0)
    assert [c.output_ids for c in a.completions] == [c.output_ids for c in b.completions]


def test_auto_tier_is_the_devices_own():
    assert resolve_tier("auto", "cpu") == "disk" and resolve_tier("auto", "cuda") == "host"
    assert resolve_tier("host", "cpu") == "host"
    with pytest.raises(MoebenchError, match="unknown --offload-tier 'tape'"):
        resolve_tier("tape", "cpu")
