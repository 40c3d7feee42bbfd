"""The budgeted expert store: offloading is exact, eviction never drops an expert in use, the
metrics add up, and bad budgets are refused with a clear message."""


import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.store.expert_store import STEP_KEYS, PooledStore, ResidentStore
from moebench.engine.store.factory import make_store_and_prefetcher, slots_for_budget
from moebench.engine.store.tiers import DiskTier, ExpertTier, HostTier
from moebench.errors import MoebenchError
from tiny_models import make_tiny_checkpoint, sharded_copy

E, K, LAYERS = 16, 2, 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A bfloat16 checkpoint (as most are shipped) run in float32: loads from either tier upcast."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen3_e6_k2_norm", dtype=torch.bfloat16,
                                num_experts=E, num_hidden_layers=LAYERS)
    return load_checkpoint(path)


def prompts(vocab, lengths=(5, 11, 17), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def generate(ckpt, **runtime):
    ids = prompts(ckpt.config.vocab_size)
    rt = RuntimeConfig(batch_size=len(ids), max_new_tokens=20, **runtime)
    return Engine(ckpt, None, rt).generate([Request(f"r{i}", "") for i in range(len(ids))], prompt_ids=ids)


@pytest.fixture(scope="module")
def resident(ckpt):
    return [c.output_ids for c in generate(ckpt).completions]


# the disk tier's page-aligned read buffers take rows of the budget: more of the small bfloat16 rows
@pytest.mark.parametrize("tier,budget", [("host", 0.5), ("host", 0.75), ("disk", 0.75), ("disk", 0.875)])
@pytest.mark.parametrize("prefetch", ["off", "lookahead"])
def test_offloaded_outputs_identical_to_resident(ckpt, resident, budget, tier, prefetch):
    result = generate(ckpt, expert_budget=budget, offload_tier=tier, prefetch=prefetch)
    assert [c.output_ids for c in result.completions] == resident
    assert result.activation_errors == []
    ev = result.evidence["prefetch"]
    assert ev["store"] in ("pooled", "pooled-native") and ev["slots_per_layer"] == int(budget * E)
    assert ev["expert_misses"] > 0  # the budget really bit
    # the budget is all the store holds: its rows, less the rows the read buffers take; no staging beside
    row_bytes = ckpt.config.expert_param_count * getattr(torch, ev["expert_dtype"]).itemsize
    assert ev["rows"] == int(budget * E) * LAYERS - -(-ev["read_buffer_bytes"] // row_bytes)
    assert ev["expert_pool_bytes"] == ev["rows"] * row_bytes
    if tier == "host":  # the host tier's copy of every expert (the loaded checkpoint's, float32 here) counts
        assert ev["host_copy_bytes"] >= LAYERS * E * ckpt.config.expert_param_count * 2
    assert ev["expert_memory_bytes"] == ev["expert_pool_bytes"] + ev["host_copy_bytes"] + ev["read_buffer_bytes"]
    assert ev["process_rss_peak_bytes"] > 0
    if prefetch == "lookahead":
        assert ev["prefetch_hits"] > 0 and ev["prefetch_issued"] >= ev["prefetch_hits"]
    else:
        assert ev["prefetch_issued"] == 0
    if tier == "disk":
        assert ev["read_mode"] in ("o_direct", "fadvise") and ev["disk_requests"] > 0


def test_fused_kernel_on_shared_and_borrowed_rows_is_exact(ckpt):
    """The fused kernel gets the whole buffer every layer shares, its ids naming rows of it, some of
    them borrowed from other layers: only the rows the ids name may matter."""
    fused_resident = [c.output_ids for c in generate(ckpt, kernel="fused").completions]
    result = generate(ckpt, expert_budget=0.4, offload_tier="host", prefetch="lookahead", kernel="fused")
    assert [c.output_ids for c in result.completions] == fused_resident
    assert result.evidence["prefetch"]["borrowed_rows"] > 0


def test_step_metrics_sum_up(ckpt):
    result = generate(ckpt, expert_budget=0.5, prefetch="lookahead")
    ev = result.evidence["prefetch"]
    for s in result.steps:
        assert set(STEP_KEYS) <= set(s)
        # one look-up per distinct expert per MoE layer call
        assert s["expert_hits"] + s["expert_misses"] == round(s["distinct_experts"] * LAYERS)
        assert s["prefetch_hits"] <= s["prefetch_issued"] or s["prefetch_issued"] == 0
        assert s["stall_s"] >= 0 and s["bytes_loaded"] >= 0
    for key in ("expert_hits", "expert_misses", "prefetch_issued", "prefetch_hits", "bytes_loaded"):
        assert sum(s[key] for s in result.steps) == ev[key]
    assert ev["lookups"] == ev["expert_hits"] + ev["expert_misses"]
    assert ev["hit_rate"] == pytest.approx(ev["expert_hits"] / ev["lookups"])
    assert ev["prefetch_precision"] == pytest.approx(ev["prefetch_hits"] / ev["prefetch_issued"])
    assert sum(s["stall_s"] for s in result.steps) == pytest.approx(ev["stall_s"])


def test_resident_store_reports_hits_only(ckpt):
    result = generate(ckpt)
    ev = result.evidence["prefetch"]
    assert ev["store"] == "resident" and ev["expert_misses"] == 0 and ev["hit_rate"] == 1.0
    assert all(s["expert_misses"] == 0 and s["bytes_loaded"] == 0 for s in result.steps)


def test_budget_one_with_lookahead_is_an_activation_error(ckpt, resident):
    """An idle prefetcher is no result: it fails activation, saying how to give it work."""
    result = generate(ckpt, expert_budget=1.0, prefetch="lookahead")
    assert [c.output_ids for c in result.completions] == resident
    assert "nothing to prefetch" in result.evidence["prefetch"]["lookahead"]
    (error,) = result.activation_errors
    assert "nothing to prefetch" in error and "--expert-budget" in error


class CountingTier(HostTier):
    batched = False  # one `load` per expert, so each is counted
    load_many = ExpertTier.load_many

    def __init__(self, ckpt):
        super().__init__(ckpt, "cpu")
        self.loads = []

    def describe(self, layer, expert, w13_addr, w2_addr):  # native loads (the default on CPU)
        self.loads.append((layer, expert))
        return super().describe(layer, expert, w13_addr, w2_addr)

    def load(self, layer, expert, w13_dst, w2_dst):  # Python loads
        self.loads.append((layer, expert))
        return super().load(layer, expert, w13_dst, w2_dst)


def pooled(ckpt, slots, workers=0, tier=None):
    rt = RuntimeConfig(expert_budget=slots / E)
    return PooledStore(ckpt, rt, tier or CountingTier(ckpt), slots, workers)


def assert_serves(ckpt, store, layer, ids):
    w13, w2, slot_ids = store.fetch(layer, ids)
    ref = ckpt.layers[layer]
    assert torch.equal(w13[slot_ids], ref.w13[ids]) and torch.equal(w2[slot_ids], ref.w2[ids])


def test_lru_evicts_least_recently_used_and_never_one_in_use(ckpt):
    store = pooled(ckpt, slots=6)  # starts holding experts 0..5
    pool = store.pools[0]
    assert_serves(ckpt, store, 0, torch.tensor([[1, 0]]))  # least recent first: 2, 3, 4, 5, 0, 1
    assert_serves(ckpt, store, 0, torch.tensor([[7, 2]]))  # 7 evicts 3 (2 is in use, 3 is the oldest)
    assert set(pool.slot_of) == {0, 1, 2, 4, 5, 7}
    # a call needing four experts, two of them missing: both victims must come from outside the call
    assert_serves(ckpt, store, 0, torch.tensor([[9, 0], [8, 7]]))
    assert set(pool.slot_of) == {0, 1, 2, 7, 8, 9}
    assert store.tier.loads == [(0, 7), (0, 8), (0, 9)]
    assert store.evidence()["borrowed_rows"] == 0  # within its share a layer evicts its own experts
    step = store.take_step()
    assert (step["expert_hits"], step["expert_misses"]) == (2 + 1 + 2, 3)
    assert step["bytes_loaded"] == 3 * store.tier.expert_bytes


@pytest.mark.parametrize("workers", [0, 2])
def test_random_calls_always_served_exactly(ckpt, workers):
    """Property test: whatever the history and however wrong the predictions, every call gets the
    right weights for every id, including loads still in flight from the prefetch workers."""
    g = torch.Generator().manual_seed(3)
    store = pooled(ckpt, slots=6, workers=workers)
    for _ in range(150):
        layer = int(torch.randint(0, LAYERS, (1,), generator=g))
        tokens = int(torch.randint(1, 4, (1,), generator=g))
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
        if workers:
            store.prefetch((layer + 1) % LAYERS, torch.randperm(E, generator=g)[:4].tolist())
        assert_serves(ckpt, store, layer, ids)
    ev = store.evidence()
    assert ev["expert_hits"] + ev["expert_misses"] == ev["lookups"]
    store.close()


def test_calls_needing_more_experts_than_their_share_borrow_rows(ckpt):
    """12 distinct experts, 6 rows per layer: the 6 residents are used where they are (never copied),
    the 6 others take rows of the layer that ran longest ago (layer 2 here, before any call), and a
    later call of that layer takes rows back from the layer holding more than its share."""
    store = pooled(ckpt, slots=6)
    ids = torch.arange(12).view(6, 2)
    assert_serves(ckpt, store, 1, ids)
    assert store.tier.loads == [(1, e) for e in range(6, 12)]
    ev = store.evidence()
    assert ev["overflow_calls"] == 1 and ev["borrowed_rows"] == 6 and ev["expert_misses"] == 6
    assert len(store.pools[1].slot_of) == 12 and len(store.pools[2].slot_of) == 0
    assert len(store.pools[0].slot_of) == 6
    assert_serves(ckpt, store, 2, torch.tensor([[2, 4]]))
    assert set(store.pools[1].slot_of) == set(range(2, 12))  # its least recently used 0 and 1 went back
    assert store.evidence()["borrowed_rows"] == 8


def test_overflow_misses_take_own_lru_rows_first(ckpt):
    """A call larger than its layer's share still evicts that layer's experts it does not need (LRU)
    first, and only what does not fit is borrowed."""
    store = pooled(ckpt, slots=6)  # holds 0..5
    assert_serves(ckpt, store, 0, torch.tensor([[0, 6], [7, 8], [9, 10], [11, 12]]))  # 0 needed; 1..5 evictable
    pool = store.pools[0]
    assert 0 in pool.slot_of and len(pool.slot_of) == 8 and not {1, 2, 3, 4, 5} & set(pool.slot_of)
    assert store.evidence()["borrowed_rows"] == 2


def test_rows_are_never_shared_or_lost_under_random_calls(ckpt):
    """Budget accounting: whatever the calls and plans, every row is free or holds exactly one expert
    of one layer, the tables agree, and a call gets every expert it needs."""
    g = torch.Generator().manual_seed(5)
    store = pooled(ckpt, slots=6, workers=1)
    for _ in range(100):
        layer = int(torch.randint(0, LAYERS, (1,), generator=g))
        tokens = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
        planned = torch.randperm(E, generator=g)[: int(torch.randint(1, E, (1,), generator=g))]
        store.prefetch((layer + 1) % LAYERS, planned.tolist())
        assert_serves(ckpt, store, layer, ids)
        rows = list(store.free) + [r for pool in store.pools.values() for r in pool.slot_of.values()]
        assert sorted(rows) == list(range(store.rows))
        for pool in store.pools.values():
            assert {e: int(pool.table[e]) for e in range(E) if pool.table[e] >= 0} == dict(pool.slot_of)
    store.close()


def test_disk_tier_reads_exactly_what_the_checkpoint_holds(ckpt):
    for direct in (True, False):
        tier = DiskTier(ckpt, readers=2, direct=direct)
        w13 = torch.empty_like(ckpt.layers[0].w13[0])
        w2 = torch.empty_like(ckpt.layers[0].w2[0])
        for layer in range(LAYERS):
            for e in (0, 7, E - 1):
                assert tier.load(layer, e, w13, w2) == tier.expert_bytes
                assert torch.equal(w13, ckpt.layers[layer].w13[e]) and torch.equal(w2, ckpt.layers[layer].w2[e])
        assert tier.evidence()["disk_requests"] == 3 * LAYERS  # one read per expert: its tensors are adjacent
        tier.close()


def test_bad_budgets_refused(ckpt):
    cfg = ckpt.config
    with pytest.raises(MoebenchError, match=r"leaves 1 expert slots per MoE layer.*top_k=2"):
        slots_for_budget(cfg, RuntimeConfig(expert_budget=0.1))
    with pytest.raises(MoebenchError, match="larger than this machine"):
        slots_for_budget(cfg, RuntimeConfig(expert_budget="1000000GB"))
    with pytest.raises(MoebenchError, match="a fraction must be in"):
        slots_for_budget(cfg, RuntimeConfig(expert_budget=1.5))
    with pytest.raises(MoebenchError, match="a fraction must be in"):
        slots_for_budget(cfg, RuntimeConfig(expert_budget=0))
    with pytest.raises(MoebenchError, match="expected a fraction"):
        slots_for_budget(cfg, RuntimeConfig(expert_budget="lots"))
    with pytest.raises(MoebenchError, match="unknown --offload-tier"):
        make_store_and_prefetcher(ckpt, RuntimeConfig(expert_budget=0.5, offload_tier="tape"))
    expert = cfg.expert_param_count * 4
    assert slots_for_budget(cfg, RuntimeConfig(expert_budget=f"{7 * LAYERS * expert / 2**20}MiB")) == 7
    # a call can need all 16 experts of a layer: 3 layers x 5 rows cannot hold them
    with pytest.raises(MoebenchError, match=r"a call can need all 16 of one layer: use at least 0.375"):
        slots_for_budget(cfg, RuntimeConfig(expert_budget=f"{5 * LAYERS * expert / 2**20}MiB"))
    assert slots_for_budget(cfg, RuntimeConfig(expert_budget="8GB")) == E
    assert slots_for_budget(cfg, RuntimeConfig(expert_budget="0.5")) == E // 2
    store, _ = make_store_and_prefetcher(ckpt, RuntimeConfig(expert_budget="8GB"))
    assert isinstance(store, ResidentStore)


def test_engine_refuses_too_small_budget_before_running(ckpt):
    with pytest.raises(MoebenchError, match="use at least 0.375"):
        generate(ckpt, expert_budget=0.1, prefetch="lookahead")


def test_experts_kept_in_checkpoint_dtype_run_exactly(ckpt, resident):
    """With a budget below 1 the loader may keep experts in bfloat16 (half the memory): the store
    upcasts only the experts it holds, so outputs stay identical."""
    raw = load_checkpoint(ckpt.path, experts_in_checkpoint_dtype=True)
    assert raw.layers[0].w13.dtype == torch.bfloat16 and raw.layers[0].router.dtype == torch.float32
    assert torch.equal(raw.layers[0].w13.float(), ckpt.layers[0].w13)
    for tier, budget in (("host", 0.5), ("disk", 0.75)):  # (read buffers take rows: see above)
        result = generate(raw, expert_budget=budget, offload_tier=tier, prefetch="lookahead")
        assert [c.output_ids for c in result.completions] == resident
    # fully resident: the store holds them as the loader kept them
    assert [c.output_ids for c in generate(raw, expert_budget=1.0).completions] == resident


def test_both_kernels_get_bfloat16_experts_and_the_same_outputs(ckpt, monkeypatch):
    """Both kernels get a bfloat16 checkpoint's experts as stored (the fused C++ kernel widens them in
    registers, the naive loop per expert, both exactly): resident or pooled, every output equals the
    one float32 experts give."""
    import moebench.engine.store.factory as stores
    from moebench.kernels import cpu_backend
    from moebench.kernels.cpu_moe import BACKEND_CPP

    if cpu_backend() != BACKEND_CPP:
        pytest.skip("needs the C++ extension")
    runs = {}
    for kernel in ("naive", "fused"):
        for budget in (1.0, 0.5):
            result = generate(ckpt, kernel=kernel, expert_budget=budget)
            assert result.evidence["prefetch"]["expert_dtype"] == "bfloat16"
            runs[kernel, budget] = [c.output_ids for c in result.completions]
    monkeypatch.setattr(stores, "expert_store_dtype", lambda stored, compute, device: compute)
    as_float = generate(ckpt, kernel="naive")
    assert as_float.evidence["prefetch"]["expert_dtype"] == "float32"
    assert all(out == [c.output_ids for c in as_float.completions] for out in runs.values())


def test_disk_tier_on_a_sharded_checkpoint(ckpt, tmp_path, resident):
    """Gate and down projections in one shard, up projections in another: each tensor lands in its
    own part of the slot, whatever file holds it."""
    sharded = sharded_copy(ckpt, tmp_path)
    result = generate(sharded, expert_budget=0.75, offload_tier="disk", prefetch="lookahead")
    assert [c.output_ids for c in result.completions] == resident


def test_truncated_checkpoint_fails_loudly(ckpt, tmp_path):
    """An expert read that comes back short is an error naming the file, never a slot of garbage;
    so is a failure in a prefetch worker, raised by the call that needs the expert."""
    import shutil

    for f in ckpt.path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    copy = load_checkpoint(tmp_path)
    tier = DiskTier(copy, readers=1)
    data = tmp_path / "model.safetensors"
    last = max(tier.extents, key=lambda k: tier.extents[k][0].end)  # the expert stored last
    with open(data, "r+b") as f:
        f.truncate(tier.extents[last][0].end - 100)
    w13 = torch.empty_like(ckpt.layers[0].w13[0])
    w2 = torch.empty_like(ckpt.layers[0].w2[0])
    with pytest.raises(MoebenchError, match="short read"):
        tier.load(*last, w13, w2)
    store = PooledStore(copy, RuntimeConfig(expert_budget=0.5), tier, 8, workers=1)
    layer, expert = last
    store.prefetch(layer, [expert])
    store.fetch((layer + 1) % LAYERS, torch.tensor([[0, 1]]))
    with pytest.raises(MoebenchError, match="short read"):
        store.fetch(layer, torch.tensor([[expert, 0]]))
    store.close()
