"""prefetch=lookahead: the prediction uses the next layer's router, precision and recall are counted
right, wrong predictions cost nothing once cancelled, and an inactive prefetcher is an error."""

import os
import threading
import time

import pytest
import torch

from moebench.engine import RuntimeConfig, load_checkpoint
from moebench.engine.config import StoreTuning
from moebench.engine.store.expert_store import PooledStore, loader_cpus
from moebench.engine.store.tiers import ExpertTier, HostTier
from moebench.engine.store.prefetch import LookaheadPrefetcher
from moebench.errors import MoebenchError
from moebench.kernels import expert_loader
from tiny_models import make_tiny_checkpoint

E, K, LAYERS = 16, 2, 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen3_e6_k2_norm", dtype=torch.bfloat16,
                                num_experts=E, num_hidden_layers=LAYERS)
    return load_checkpoint(path)


class GatedTier(HostTier):
    """Loads of the experts in `gated` wait until the test opens the gate."""

    batched = False  # one `load` per expert, so each can be gated
    load_many = ExpertTier.load_many

    def __init__(self, ckpt, gated=()):
        super().__init__(ckpt, "cpu")
        self.gated, self.gate, self.started, self.loads = set(gated), threading.Event(), threading.Event(), []

    def prepare_native(self, dst_dtype):
        return False  # loads stay in Python, where the gate can hold them (native ones: tests below)

    def load(self, layer, expert, w13_dst, w2_dst):
        if expert in self.gated:
            self.started.set()
            assert self.gate.wait(10)
        self.loads.append((layer, expert))
        return super().load(layer, expert, w13_dst, w2_dst)


def store_for(ckpt, slots=6, workers=1, tier=None):
    return PooledStore(ckpt, RuntimeConfig(expert_budget=slots / E), tier or GatedTier(ckpt), slots, workers)


def test_precision_recall_and_prefetch_hits(ckpt):
    store = store_for(ckpt)  # holds experts 0..5 in every layer
    # Layer 1 predicted {2, 8, 9}: 8 and 9 are loaded ahead, 2 is already resident.
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8, 9, 2])
    step = store.take_step()
    assert step["prefetch_issued"] == 2
    store.fetch(1, torch.tensor([[8, 2], [5, 2]]))  # needed {2, 5, 8}
    # Layer 2 predicted {10, 11}, needed {10, 12, 13, 14}.
    store.fetch(1, torch.tensor([[8, 2]]))
    store.prefetch(2, [10, 11])
    store.fetch(2, torch.tensor([[10, 12], [13, 14]]))
    ev = store.evidence()
    # |P & A| / |P| and / |A|, summed over the predicted calls: (2 + 1) / (3 + 2), (2 + 1) / (3 + 4)
    assert ev["prediction_precision"] == pytest.approx(3 / 5)
    assert ev["prediction_recall"] == pytest.approx(3 / 7)
    # loaded ahead: 8, 9 (layer 1), 10, 11 (layer 2); used by their call: 8 and 10
    assert (ev["prefetch_issued"], ev["prefetch_hits"]) == (4, 2)
    assert ev["prefetch_precision"] == pytest.approx(2 / 4)
    assert ev["lookups"] == ev["expert_hits"] + ev["expert_misses"] == 2 + 3 + 2 + 4
    store.close()


def test_wrong_prediction_not_started_is_cancelled_and_costs_nothing(ckpt):
    tier = GatedTier(ckpt, gated={8})
    store = store_for(ckpt, workers=1, tier=tier)
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8, 9])  # 8 blocks the only worker, so 9 waits in the queue
    assert tier.started.wait(10)
    w13, w2, ids = store.fetch(1, torch.tensor([[6, 7]]))  # neither predicted expert is needed
    assert torch.equal(w13[ids], ckpt.layers[1].w13[torch.tensor([[6, 7]])])
    ev = store.evidence()
    assert ev["prefetch_cancelled"] == 1 and 9 not in store.pools[1].slot_of
    assert (1, 9) not in tier.loads
    tier.gate.set()
    store.close()
    assert ev["bytes_loaded"] == (1 + 2) * tier.expert_bytes  # 8 (in flight) and the two misses; not 9


def test_needed_expert_still_loading_is_waited_for(ckpt):
    tier = GatedTier(ckpt, gated={8})
    store = store_for(ckpt, workers=1, tier=tier)
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8])
    threading.Timer(0.05, tier.gate.set).start()
    w13, _, ids = store.fetch(1, torch.tensor([[8, 0]]))
    assert torch.equal(w13[ids], ckpt.layers[1].w13[torch.tensor([[8, 0]])])
    ev = store.evidence()
    assert ev["late_hits"] == 1 and ev["prefetch_hits"] == 1 and ev["stall_s"] >= 0.02
    store.close()


def test_predictor_uses_each_layers_router_on_the_stream(ckpt):
    store = store_for(ckpt)
    planned = []
    store.prefetch = lambda layer, experts: planned.append((layer, experts))
    pf = LookaheadPrefetcher(ckpt, store)
    h = torch.randn(3, ckpt.config.hidden_size)

    def guess(layer, k):  # the layer's router on the normalised stream, top-k per token
        x = torch.nn.functional.rms_norm(h, (h.shape[-1],), ckpt.layers[layer].post_attention_norm, 1e-6)
        ids = torch.topk(x @ ckpt.layers[layer].router.T, k, dim=-1).indices
        return list(dict.fromkeys(ids.flatten().tolist()))

    pf.before_forward(h)  # the first MoE layer from the embeddings, one rank deeper
    pf.after_layer(0, h)  # layer 1 from the stream layer 0's MoE output was added to
    pf.after_layer(LAYERS - 1, h)  # the last layer: nothing left in this forward
    assert planned == [(0, guess(0, K + 2)), (1, guess(1, K + 1))]
    store.close()


def test_prediction_larger_than_the_layers_share_borrows_rows(ckpt):
    """At a large batch the next layer needs more experts than its share of the rows: the surplus of
    the prediction takes rows from the layer that ran last (needed again furthest ahead), is served
    from there exactly with no demand load, and the store's memory stays what the budget gave it."""
    tier = GatedTier(ckpt)
    store = store_for(ckpt, slots=6, tier=tier)  # every layer holds 0..5
    rows_before = store.rows
    wanted = list(range(2, 14))  # 12 experts: 2..5 resident; 6, 7 evict 0, 1; 8..13 borrow layer 0's rows
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, wanted)
    assert set(store.pools[0].slot_of) == set() and len(store.pools[2].slot_of) == 6
    ids = torch.tensor(wanted).view(6, 2)
    w13, w2, slot_ids = store.fetch(1, ids)
    assert torch.equal(w13[slot_ids], ckpt.layers[1].w13[ids]) and torch.equal(w2[slot_ids], ckpt.layers[1].w2[ids])
    ev = store.evidence()
    assert ev["expert_misses"] == 0 and ev["prefetch_hits"] == ev["prefetch_issued"] == 8
    assert ev["borrowed_rows"] == 6 and ev["prediction_recall"] == 1.0
    assert store.rows == rows_before and ev["expert_pool_bytes"] == store.w13.nbytes + store.w2.nbytes
    # layer 0 gets rows back from the layer holding more than its share
    assert_rows = store.fetch(0, torch.tensor([[0, 1]]))
    assert torch.equal(assert_rows[0][assert_rows[2]], ckpt.layers[0].w13[torch.tensor([[0, 1]])])
    assert len(store.pools[1].slot_of) == 10 and len(store.pools[0].slot_of) == 2
    store.close()


def test_close_with_loads_in_flight_leaves_no_thread(ckpt):
    tier = GatedTier(ckpt, gated={8})
    store = store_for(ckpt, workers=1, tier=tier)
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8, 9, 10])
    assert tier.started.wait(10)
    threading.Timer(0.05, tier.gate.set).start()
    store.close()  # waits for the running load, drops the queued ones
    assert not [t for t in threading.enumerate() if t.name.startswith("moebench-")]


def test_no_prefetch_hits_is_an_activation_error(ckpt):
    store = store_for(ckpt)
    pf = LookaheadPrefetcher(ckpt, store)
    errors = pf.activation_errors(store)
    assert len(errors) == 1 and "none was used" in errors[0]
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8])
    store.fetch(1, torch.tensor([[8, 1]]))
    assert pf.activation_errors(store) == []
    store.close()


# ---------------------------------------------------------------------------- native loader
# The default path on CPU: loads run on native threads that never take the GIL. `hold` keeps them
# queued, as the gate above does for Python loads.

native = pytest.mark.skipif(expert_loader.load_extension() is None, reason="native expert loader not built")


def _loader_affinities() -> list[set[int]]:
    """The cpu sets of the native loader's worker threads alive in this process (they name themselves)."""
    sets = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "moebench-load":
                    sets.append(os.sched_getaffinity(int(tid)))
        except OSError:  # a thread that ended meanwhile
            pass
    return sets


def _threads() -> int:
    return len(_loader_affinities())


def _threads_once_reaped(expected: int) -> int:
    """The loader threads left once joined ones are gone: a joined thread can still be listed in /proc
    for a moment (the kernel wakes the joiner before it reaps the task), so poll up to 5 s."""
    deadline = time.monotonic() + 5.0
    while (n := _threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


@native
def test_native_wrong_prediction_is_cancelled_and_needed_one_waited_for(ckpt):
    store = store_for(ckpt, tier=HostTier(ckpt, "cpu"))
    assert store.native and store.evidence()["native_loader"]
    store.executor.hold(True)
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8, 9])
    threading.Timer(0.05, store.executor.hold, (False,)).start()
    w13, w2, ids = store.fetch(1, torch.tensor([[8, 5]]))  # 8 predicted (queued: waited for), 9 not needed
    want = torch.tensor([[8, 5]])
    assert torch.equal(w13[ids], ckpt.layers[1].w13[want]) and torch.equal(w2[ids], ckpt.layers[1].w2[want])
    ev = store.evidence()
    assert ev["prefetch_cancelled"] == 1 and 9 not in store.pools[1].slot_of
    assert ev["late_hits"] == 1 and ev["prefetch_hits"] == 1 and ev["stall_s"] >= 0.02
    store.close()


@native
def test_native_close_with_loads_queued_leaves_no_thread(ckpt):
    before = _threads()
    store = store_for(ckpt, tier=HostTier(ckpt, "cpu"), workers=2)
    assert _threads() == before + 2
    store.executor.hold(True)
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8, 9, 10])
    store.close()  # cancels the queued loads, joins the workers
    assert _threads_once_reaped(before) == before


@native
def test_native_loader_copies_and_upcasts_exactly(tmp_path):
    el = expert_loader
    ext = el.load_extension()
    src = torch.randn(3, 1000).to(torch.bfloat16)
    half = torch.randn(1000).to(torch.float16)
    out32, outbf = torch.empty(3, 1000), torch.empty(3, 1000, dtype=torch.bfloat16)
    out16 = torch.empty(1000)
    loader = ext.Loader(2)
    tickets = loader.submit([(-1, 0, 0, 0, False, "mem", [el.memory_segment(src[i], out32[i]),
                                                          el.memory_segment(src[i], outbf[i])]) for i in range(3)]
                            + [(-1, 0, 0, 0, False, "mem", [el.memory_segment(half, out16)])])
    for t in tickets:
        t.result()
    assert torch.equal(out32, src.float()) and torch.equal(outbf, src) and torch.equal(out16, half.float())
    # a file range: read, then parts of it land where the segments say; a short read is an error
    data = torch.randn(4096).to(torch.bfloat16)
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 100 + data.view(torch.int16).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        got = torch.empty(4096)
        loader.run([(fd, 0, 100 + data.nbytes, 100 + data.nbytes, False, "blob", [(100, got.data_ptr(), data.nbytes,
                                                                                   el.BF16_TO_F32)])])
        assert torch.equal(got, data.float())
        with pytest.raises(ext.LoadError, match="blob: short read"):
            loader.run([(fd, 0, 2 * data.nbytes, 2 * data.nbytes, False, "blob", [])])
        (t,) = loader.submit([(fd, 0, 2 * data.nbytes, 2 * data.nbytes, False, "blob", [])])
        with pytest.raises(ext.LoadError, match="short read"):
            t.result()
    finally:
        os.close(fd)
        loader.close()


@native
def test_loader_threads_run_on_the_cores_the_model_leaves(monkeypatch):
    mine = sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    auto = RuntimeConfig()
    assert loader_cpus(auto) == mine[1:]  # the model's one thread keeps a core to itself
    monkeypatch.setattr(torch, "get_num_threads", lambda: len(mine))
    assert loader_cpus(auto) == []  # the model uses every core: the loaders share them
    assert loader_cpus(RuntimeConfig(store=StoreTuning(loader_cpus="any"))) == []
    assert loader_cpus(RuntimeConfig(store=StoreTuning(loader_cpus=str(mine[-1])))) == [mine[-1]]
    with pytest.raises(MoebenchError, match="not among this process's cpus"):
        loader_cpus(RuntimeConfig(store=StoreTuning(loader_cpus="4096")))
    with pytest.raises(MoebenchError, match="expected auto, any or a list"):
        loader_cpus(RuntimeConfig(store=StoreTuning(loader_cpus="last")))
    ext = expert_loader.load_extension()
    before = len(_loader_affinities())
    loader = ext.Loader(3, 0, [mine[-1]])
    try:
        pinned = _loader_affinities()
        assert len(pinned) == before + 3 and pinned.count({mine[-1]}) >= 3
    finally:
        loader.close()
    with pytest.raises(ValueError, match="cpus outside"):
        ext.Loader(2, 0, [4096])
    assert _threads_once_reaped(before) == before  # the refused loader left no thread behind


def test_a_second_guess_inside_the_first_issues_nothing(ckpt):
    """The late guess often repeats the early one: what it names is resident or loading already."""
    store = store_for(ckpt)
    store.fetch(0, torch.tensor([[0, 1]]))
    store.prefetch(1, [8, 9, 2])
    assert store.take_step()["prefetch_issued"] == 2
    store.prefetch(1, [9, 2])
    assert store.take_step()["prefetch_issued"] == 0
    store.prefetch(1, [9, 10])  # one new expert: only it is loaded
    assert store.take_step()["prefetch_issued"] == 1
    assert store.pools[1].predicted == {2, 8, 9, 10}
    store.close()


def test_early_guess_uses_the_next_router_on_this_layers_moe_input(ckpt):
    """Slow tiers guess layer L+1 from layer L's MoE input as well (x = h * w_L / rms(h)); a second
    guess for the same call adds to the first."""
    store = store_for(ckpt, slots=8)
    planned = []
    store.prefetch = lambda layer, experts: planned.append((layer, experts))
    h = torch.randn(3, ckpt.config.hidden_size)
    w0, w1 = ckpt.layers[0].post_attention_norm, ckpt.layers[1].post_attention_norm
    x = torch.nn.functional.rms_norm(h, (h.shape[-1],), w0, 1e-6)
    LookaheadPrefetcher(ckpt, store).before_layer(0, x)
    assert planned == []  # fast tiers: the late guess only
    LookaheadPrefetcher(ckpt, store, early=True).before_layer(0, x)
    want = torch.topk(torch.nn.functional.rms_norm(h, (h.shape[-1],), w1, 1e-6) @ ckpt.layers[1].router.T,
                      K + 1, dim=-1).indices
    assert planned[0][0] == 1 and set(planned[0][1]) == set(want.flatten().tolist())
    del store.prefetch
    store.prefetch(1, [8, 9])
    store.prefetch(1, [9, 10])
    assert store.pools[1].predicted == {8, 9, 10}
    store.close()


def test_governor_measures_both_modes_and_keeps_the_cheaper():
    """A window of `window` plans predicting, one not predicting; cost per look-up = (guess time +
    stall) / look-ups with predictions, stall / look-ups without; the cheaper mode runs `keep` windows,
    then the other is measured again."""
    from types import SimpleNamespace

    from moebench.engine.store.prefetch import PlanGovernor

    total = {"stall_s": 0.0, "lookups": 0}
    store = SimpleNamespace(counters=SimpleNamespace(total=total))
    gov = PlanGovernor(store, window=2, keep=3)

    def plans(n, guess_s, stall_s_per_plan):
        made = []
        for _ in range(n):
            made.append(gov.should_plan())
            if made[-1]:
                gov.planned(guess_s)
            total["stall_s"] += stall_s_per_plan[made[-1]]
            total["lookups"] += 4
        return made

    # loads are cheap: predicting saves 1 us of stall per plan but guessing costs 30 us
    cheap = {True: 19e-6, False: 20e-6}
    assert plans(2, 30e-6, cheap) == [True, True]  # the first window predicts
    assert plans(2, 30e-6, cheap) == [False, False]  # the second measures not predicting
    assert plans(6, 30e-6, cheap) == [False] * 6  # not predicting was cheaper: kept 3 windows
    assert gov.pauses == 1 and gov.evidence()["lookahead_last_decision"]["predicting"] is False
    # loads become costly (a disk): predictions are measured again, lose against the last (cheap)
    # measure of not predicting, whose next stretch measures it afresh; then predictions win and resume
    costly = {True: 50e-6, False: 400e-6}
    assert plans(2, 30e-6, costly) == [True, True]
    assert plans(6, 30e-6, costly) == [False] * 6
    assert plans(2, 30e-6, costly) == [True, True]
    assert plans(6, 30e-6, costly) == [True] * 6
    assert (gov.pauses, gov.resumes) == (2, 2) and gov.evidence()["lookahead_last_decision"]["predicting"] is True
    assert gov.skipped == 14
