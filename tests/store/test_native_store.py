"""The native expert store against the Python one it must equal: the same random calls (batch-1 and
batch-16-like id sets, prefills needing every expert, right and wrong predictions, several layers,
budgets tight enough to force borrowing) through both, asserting the same rows, the same residency,
LRU order and free rows, the same counters and evidence (timing fields aside), and the right expert
weights in every row; generated tokens bit-identical to all-resident; a short read still a
MoebenchError."""

import random
import shutil

import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.overrides import Overrides
from moebench.engine.store.expert_store import PooledStore
from moebench.engine.store.factory import make_store_and_prefetcher
from moebench.engine.store.native import NativePooledStore
from moebench.engine.store.tiers import DiskTier, HostTier
from moebench.errors import MoebenchError
from moebench.kernels.expert_loader import load_extension
from tiny_models import make_tiny_checkpoint, sharded_copy

E, K, LAYERS = 16, 2, 3
TIMING = {"stall_s", "process_rss_peak_bytes", "rss_peak_since_process_start"}

pytestmark = pytest.mark.skipif(load_extension() is None, reason="needs the native loader (C++ toolchain)")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen3_e6_k2_norm", dtype=torch.bfloat16,
                                num_experts=E, num_hidden_layers=LAYERS)
    return load_checkpoint(path)


def make_tier(ckpt, name):
    return HostTier(ckpt, "cpu") if name == "host" else DiskTier(ckpt, readers=2)


def both_stores(ckpt, tier, slots, workers):
    """(reference, native) on tiers of their own, built alike."""
    rt = RuntimeConfig(expert_budget=slots / E)
    demand = tier == "disk"
    ref = PooledStore(ckpt, rt, make_tier(ckpt, tier), slots, workers, parallel_demand=demand)
    nat = NativePooledStore(ckpt, rt, make_tier(ckpt, tier), slots, workers, parallel_demand=demand)
    return ref, nat


def state_of(store) -> dict:
    """Residency (expert -> row, LRU order), loads in flight, predictions, free rows, layer order."""
    if isinstance(store, NativePooledStore):
        n = store.native_store
        layers = range(LAYERS)
        return {"held": {i: n.held(i) for i in layers}, "table": {i: list(n.table(i)) for i in layers},
                "loading": {i: n.loading(i) for i in layers}, "predicted": {i: n.predicted(i) for i in layers},
                "free": n.free_rows(), "recent": n.recent()}
    pools = store.pools
    return {"held": {i: list(p.slot_of.items()) for i, p in pools.items()},
            "table": {i: p.table.tolist() for i, p in pools.items()},
            "loading": {i: list(p.loading) for i, p in pools.items()},
            "predicted": {i: p.predicted for i, p in pools.items()},
            "free": list(store.free), "recent": [p.layer for p in store.recent]}


def settle(store) -> None:
    """Let every load in flight end, so that whether a later call finds it done is not up to timing."""
    if isinstance(store, NativePooledStore):
        store.native_store.settle()
    else:
        for pool in store.pools.values():
            for fut in pool.loading.values():
                fut.result()


def without_timing(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMING and k != "store"}


def random_ids(rng: random.Random, kind: str) -> torch.Tensor:
    if kind == "prefill":  # every expert of the layer, several times over
        return torch.tensor([rng.sample(range(E), K) for _ in range(3 * E)] + [[e, (e + 1) % E] for e in range(E)])
    tokens = 1 if kind == "batch1" else 16
    return torch.tensor([rng.sample(range(E), K) for _ in range(tokens)])


def guess_for(rng: random.Random, ids: torch.Tensor) -> list[int]:
    """A prediction for a call: right, wrong or partly right, most wanted first, distinct."""
    needed = list(dict.fromkeys(ids.flatten().tolist()))
    mode = rng.choice(["right", "wrong", "partly"])
    if mode == "right":
        return needed[: rng.randint(1, len(needed))]
    wrong = rng.sample(range(E), rng.randint(1, 6))
    guess = wrong if mode == "wrong" else needed[: max(1, len(needed) // 2)] + wrong
    return list(dict.fromkeys(guess))


def call_both(ckpt, ref, nat, layer, ids):
    out = []
    for store in (ref, nat):
        w13, w2, rows = store.fetch(layer, ids)
        want = ckpt.layers[layer]
        assert torch.equal(w13[rows], want.w13[ids]) and torch.equal(w2[rows], want.w2[ids])
        out.append(rows)
    assert torch.equal(out[0], out[1])
    assert state_of(ref) == state_of(nat)
    step_ref, step_nat = ref.take_step(), nat.take_step()
    assert without_timing(step_ref) == without_timing(step_nat) and set(step_ref) == set(step_nat)


def prefetch_both(ref, nat, layer, guess):
    for store in (ref, nat):
        store.prefetch(layer, guess)
    assert state_of(ref) == state_of(nat)


@pytest.mark.parametrize("tier,slots,workers", [("host", 6, 1), ("host", 7, 0), ("disk", 8, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traces_match_the_reference(ckpt, tier, slots, workers, seed):
    """Loads settled before each call: prefetch hits, evictions of loaded rows and borrowing agree."""
    rng = random.Random(seed)
    ref, nat = both_stores(ckpt, tier, slots, workers)
    assert state_of(ref) == state_of(nat)
    try:
        layer = 0
        for _ in range(120):
            kind = rng.choices(["batch1", "batch16", "prefill"], weights=[6, 3, 1])[0]
            ids = random_ids(rng, kind)
            if workers and rng.random() < 0.8:
                prefetch_both(ref, nat, layer, guess_for(rng, ids))
                if rng.random() < 0.3:  # a second, late guess for the same call
                    prefetch_both(ref, nat, layer, guess_for(rng, ids))
                settle(ref)
                settle(nat)
            call_both(ckpt, ref, nat, layer, ids)
            layer = (layer + 1) % LAYERS if rng.random() < 0.9 else rng.randrange(LAYERS)
        ev_ref, ev_nat = ref.evidence(), nat.evidence()
        assert ev_ref["store"] == "pooled" and ev_nat["store"] == "pooled-native"
        assert without_timing(ev_ref) == without_timing(ev_nat)
        assert ev_nat["expert_misses"] > 0 and ev_nat["evictions"] > 0 and ev_nat["borrowed_rows"] > 0
        if workers:
            assert ev_nat["prefetch_hits"] > 0 and ev_nat["prediction_precision"] < 1
    finally:
        ref.close()
        nat.close()


@pytest.mark.parametrize("tier,slots", [("host", 6), ("disk", 8)])
def test_random_traces_with_loads_held_in_the_queue_match_the_reference(ckpt, tier, slots):
    """Prefetch workers held: every prefetch stays queued, so wrong guesses are cancelled, claims
    skip rows being written (or, for a demand load with nothing else left, cancel them) the same
    way in both stores. Calls never need an expert still queued for their own layer (it would be
    waited for forever)."""
    rng = random.Random(7)
    ref, nat = both_stores(ckpt, tier, slots, workers=2)
    try:
        for store in (ref, nat):
            store.executor.hold(True)
        layer = 0
        for _ in range(100):
            if rng.random() < 0.8:
                guess = rng.sample(range(E), rng.randint(1, 8))
                prefetch_both(ref, nat, (layer + 1) % LAYERS, guess)
            queued = set(ref.pools[layer].loading)
            free = [e for e in range(E) if e not in queued]
            kind = rng.choices(["batch1", "batch16", "prefill"], weights=[6, 3, 1])[0]
            if kind == "prefill" and not queued:
                ids = random_ids(rng, "prefill")
            else:
                tokens = 1 if kind == "batch1" else 16
                ids = torch.tensor([rng.sample(free, K) for _ in range(tokens)])
            call_both(ckpt, ref, nat, layer, ids)
            layer = (layer + 1) % LAYERS
        ev_ref, ev_nat = ref.evidence(), nat.evidence()
        assert without_timing(ev_ref) == without_timing(ev_nat)
        assert ev_nat["prefetch_cancelled"] > 0
    finally:
        ref.close()
        nat.close()


def test_a_hit_is_served_from_the_table_without_loading(ckpt):
    ref, nat = both_stores(ckpt, "host", 6, 0)
    w13, w2, rows = nat.fetch(1, torch.tensor([[0, 5], [3, 0]]))
    assert rows.dtype == torch.int64 and rows.shape == (2, 2)
    assert rows.tolist() == [[nat.native_store.table(1)[e] for e in pair] for pair in ([0, 5], [3, 0])]
    step = nat.take_step()
    assert (step["expert_hits"], step["expert_misses"], step["bytes_loaded"]) == (3, 0, 0)
    with pytest.raises(IndexError, match="out of range"):
        nat.fetch(1, torch.tensor([[0, E]]))
    ref.close()
    nat.close()


def generate(ckpt, **runtime):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, ckpt.config.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 17)]
    rt = RuntimeConfig(batch_size=len(ids), max_new_tokens=20, **runtime)
    return Engine(ckpt, None, rt).generate([Request(f"r{i}", "") for i in range(len(ids))], prompt_ids=ids)


# (the fused kernel's rows hold bfloat16 experts: on disk the read buffers would take too many of them)
@pytest.mark.parametrize("tier,kernel", [("host", "naive"), ("disk", "naive"), ("host", "fused")])
@pytest.mark.parametrize("prefetch", ["off", "lookahead"])
def test_native_store_outputs_identical_to_resident(ckpt, tier, prefetch, kernel):
    resident = [c.output_ids for c in generate(ckpt, kernel=kernel).completions]
    # tight: 6 of 16 rows per layer (8 on disk, whose read buffers take rows), so prefills borrow
    result = generate(ckpt, expert_budget=0.4 if tier == "host" else 0.75, offload_tier=tier, prefetch=prefetch,
                      kernel=kernel)
    assert [c.output_ids for c in result.completions] == resident
    assert result.activation_errors == []
    ev = result.evidence["prefetch"]
    assert ev["store"] == "pooled-native" and ev["expert_misses"] > 0 and ev["borrowed_rows"] > 0
    if prefetch == "lookahead":
        assert ev["prefetch_hits"] > 0


def test_store_choice(ckpt, monkeypatch, tmp_path):
    store, _ = make_store_and_prefetcher(ckpt, RuntimeConfig(expert_budget=0.5, offload_tier="host",
                                                             overrides=Overrides(expert_store="python")))
    assert type(store) is PooledStore and store.evidence()["store"] == "pooled"
    store.close()
    store, _ = make_store_and_prefetcher(ckpt, RuntimeConfig(expert_budget=0.5, offload_tier="host",
                                                             overrides=Overrides(expert_store="native")))
    assert isinstance(store, NativePooledStore)
    store.close()
    # the variable feeds the override where a command starts; a bad value is one line there
    assert Overrides.from_environment({"MOEBENCH_EXPERT_STORE": "python"}).expert_store == "python"
    with pytest.raises(MoebenchError, match="MOEBENCH_EXPERT_STORE=fast: choose from auto, native, python"):
        Overrides.from_environment({"MOEBENCH_EXPERT_STORE": "fast"})
    # a tier that cannot describe its loads natively: the Python store, loudly; an error where asked for
    sharded = sharded_copy(ckpt, tmp_path)
    with pytest.warns(RuntimeWarning, match="native expert store cannot run"):
        store, _ = make_store_and_prefetcher(sharded, RuntimeConfig(expert_budget=0.75, offload_tier="disk"))
    assert type(store) is PooledStore
    store.close()
    with pytest.raises(MoebenchError, match="'native' cannot run: the disk tier cannot describe"):
        make_store_and_prefetcher(sharded, RuntimeConfig(expert_budget=0.75, offload_tier="disk",
                                                         overrides=Overrides(expert_store="native")))


@pytest.mark.parametrize("workers", [0, 1])
def test_short_read_is_the_same_error(ckpt, tmp_path, workers):
    """A truncated file: the demand load (in this thread) or the prefetch (on a worker) that reads
    the last expert fails with the MoebenchError the Python store raises, naming the file."""
    for f in ckpt.path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    copy = load_checkpoint(tmp_path)
    errors = []
    for cls in (PooledStore, NativePooledStore):
        tier = DiskTier(copy, readers=1)
        last = max(tier.extents, key=lambda k: tier.extents[k][0].end)  # the expert stored last
        with open(tmp_path / "model.safetensors", "r+b") as f:
            f.truncate(tier.extents[last][0].end - 100)
        store = cls(copy, RuntimeConfig(expert_budget=0.5), tier, 8, workers=workers)
        layer, expert = last
        if workers:
            store.prefetch(layer, [expert])
            store.fetch((layer + 1) % LAYERS, torch.tensor([[0, 1]]))
        with pytest.raises(MoebenchError, match="short read") as raised:
            store.fetch(layer, torch.tensor([[expert, 0]]))
        errors.append(str(raised.value))
        store.close()
    assert errors[0] == errors[1] and "model.safetensors" in errors[0]
