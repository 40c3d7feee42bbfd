"""The extension's small decode-step ops (kernels/csrc/norms_cpu.cpp, attention_cpu.cpp,
routing_cpu.cpp) compute exactly what the
torch ops they replace compute: each op against its torch counterpart bit for bit, then whole
forward passes (prefill, decode, mixed steps) with and without them, and with their chains
(kernels/csrc/decode_layer.cpp) against the same ops called one by one. Routing statistics counted
in numpy give what the torch counting gave."""

import pytest
import torch
import torch.nn.functional as F

from moebench.engine import load_checkpoint
from moebench.engine import model as model_mod
from moebench.engine.decode_path import decide as decide_decode_path
from moebench.engine.store.expert_store import NoPrefetch, ResidentStore
from moebench.engine.kv_cache import KVCache
from moebench.engine.overrides import Overrides
from moebench.engine.model import MoeTransformer, RotaryEmbedding, build_forward_batch, cpu_step_ops, rms_norm
from moebench.engine.moe import MoeBlock, make_kernel
from moebench.engine.moe import RoutingStats
from moebench.kernels import cpu_routing
from moebench.kernels.cpu_attention import paged_decode_attention
from moebench.kernels.reference import route_softmax_topk
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ops():
    ext = cpu_step_ops()
    if ext is None:
        pytest.skip("the CPU extension is not available")
    return ext


@pytest.mark.parametrize("dim", [40, 192, 7])
def test_add_rms_norm_is_add_then_rms_norm(ops, dim):
    g = torch.Generator().manual_seed(dim)
    for n in (1, 3, 16, 67):
        h = torch.randn(n, dim, generator=g) * 3
        delta = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, generator=g)
        expect_h = h + delta
        expect = F.rms_norm(expect_h, (dim,), w, 1e-6)
        out = ops.add_rms_norm(h, delta, w, 1e-6)
        assert torch.equal(h, expect_h) and torch.equal(out, expect)
        assert torch.equal(ops.add_rms_norm(h, None, w, 1e-5), F.rms_norm(h, (dim,), w, 1e-5))


def test_rms_norm_sum_order_every_length(ops):
    """The mean of squares is summed in torch's order (calibrated per row length against torch):
    rows of 1 to 300 values and a few long ones, values spread over many binades."""
    g = torch.Generator().manual_seed(7)
    for dim in [*range(1, 301), 1023, 1024, 2048, 2560, 4096, 5000]:
        x = torch.randn(5, dim, generator=g) * torch.exp2(torch.randint(-12, 12, (5, dim), generator=g).float())
        w = torch.randn(dim, generator=g)
        assert torch.equal(ops.add_rms_norm(x.clone(), None, w, 1e-6), F.rms_norm(x, (dim,), w, 1e-6)), dim
    if ops.rms_sum_width(192) == 0:
        pytest.skip("torch's sum order was not recognised here: RMSNorm calls torch's mean (exact, slower)")


def test_rms_norm_with_two_threads(ops):
    """torch splits the rows of a large norm over threads, and one very long row too."""
    g = torch.Generator().manual_seed(8)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for shape in ((400, 192), (1, 40000), (3, 40000)):
            x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
            w = torch.randn(shape[1], generator=g)
            assert torch.equal(ops.add_rms_norm(x.clone(), None, w, 1e-6), F.rms_norm(x, (shape[1],), w, 1e-6)), shape
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 48), (6, 2, 16), (3, 3, 10)])
def test_decode_attention_block_is_norm_rope_write_attention(ops, qk_norm, window, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    block, num_blocks = 4, 48
    rope = RotaryEmbedding(dim, 10000.0, "cpu")
    for batch in (1, 5, 16):
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=g) * 2
        qw, kw = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
        k_pool = torch.randn(num_blocks * block, kv_heads, dim, generator=g)
        v_pool = torch.randn(num_blocks * block, kv_heads, dim, generator=g)
        lens = torch.randint(1, 6 * block, (batch,), generator=g)
        blocks = torch.stack([torch.randperm(num_blocks, generator=g)[:6] for _ in range(batch)])
        pos = lens - 1
        slots = blocks.gather(1, (pos // block)[:, None])[:, 0] * block + pos % block
        # the torch path of MoeTransformer.attention
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = q.view(batch, heads, dim), k.view(batch, kv_heads, dim), v.view(batch, kv_heads, dim)
        if qk_norm:
            q, k = rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6)
        cos, sin = rope.tables(pos, torch.float32)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        k_expect, v_expect = k_pool.clone().index_copy_(0, slots, k), v_pool.clone().index_copy_(0, slots, v)
        expect = paged_decode_attention(q, k_expect, v_expect, blocks, lens, block, 0.3, window)

        out = ops.decode_attention_block(qkv, qw if qk_norm else None, kw if qk_norm else None, 1e-6, rope.cos,
                                         rope.sin, pos, k_pool, v_pool, slots, blocks, lens, block, 0.3, window, heads)
        assert torch.equal(k_pool, k_expect) and torch.equal(v_pool, v_expect)
        assert torch.equal(out, expect.view(batch, heads * dim))


def test_decode_attention_block_refuses_a_slot_outside_the_pool(ops):
    rope = RotaryEmbedding(8, 10000.0, "cpu")
    qkv, pool = torch.randn(1, 4 * 8), torch.randn(16, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.decode_attention_block(qkv, None, None, 1e-6, rope.cos, rope.sin, torch.tensor([2]), pool, pool.clone(),
                                   torch.tensor([16]), torch.tensor([[0]]), torch.tensor([3]), 4, 1.0, 0, 2)


@pytest.mark.parametrize("experts,k,renormalize", [(16, 2, True), (6, 2, True), (5, 1, True), (5, 1, False),
                                                   (7, 4, False), (64, 8, False)])
def test_route_topk_is_the_reference_top_k(ops, experts, k, renormalize):
    g = torch.Generator().manual_seed(experts + k)
    for n in (1, 16, 45):
        logits = torch.randn(n, experts, generator=g) * 2
        logits[0, 1:3] = logits[0, 0]  # ties: the lower index first
        if n > 1:
            logits[1] = 0.5  # a row of equal values
        probs = torch.softmax(logits, dim=-1)
        expect_w, expect_ids = route_softmax_topk(logits, k, renormalize)
        w, ids = ops.route_topk(probs, k, renormalize)
        assert torch.equal(ids, expect_ids) and torch.equal(w, expect_w)


@pytest.mark.parametrize("experts,k", [(128, 8), (64, 6), (60, 4), (32, 3), (256, 16)])
def test_route_topk_renormalizes_like_torch_beyond_two(ops, experts, k):
    """Beyond two weights the renormalizing sum has an order: the op sums in torch's (or lets torch
    divide where no order reproduces it), for every batch a decode step can have, on rows whose
    weights range widely (where orders disagree)."""
    g = torch.Generator().manual_seed(experts * k)
    checked = 0
    for n in (1, 2, 3, 7, 16, 32, 45):
        for _ in range(20):
            logits = torch.randn(n, experts, generator=g) * torch.rand(n, 1, generator=g) * 12
            probs = torch.softmax(logits, dim=-1)
            expect_w, expect_ids = route_softmax_topk(logits, k, True)
            w, ids = ops.route_topk(probs, k, True)
            assert torch.equal(ids, expect_ids) and torch.equal(w, expect_w), (n, k)
        checked += ops.topk_sum_matches_torch(k, n)
    assert checked >= 4  # the orders torch takes on this machine are reproduced for most batch sizes


class _CallCounter:
    """The extension's ops, counting the calls the model makes to each."""

    def __init__(self, ops):
        self.ops, self.calls = ops, {}

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return op(*args)
        return counted


def _forward_logits(ckpt, use_ops: bool, monkeypatch, chains: bool = True, calls: dict | None = None):
    """Logits of a prefill of three prompts, a mixed step (one prompt more) and decode steps."""
    if not use_ops:
        monkeypatch.setattr(model_mod, "cpu_step_ops", lambda: None)
    model = MoeTransformer(ckpt, None, overrides=Overrides(chains=chains))
    monkeypatch.undo()
    if not use_ops:  # the router's top-k as where the extension is not built: the torch reference
        monkeypatch.setattr(cpu_routing, "load_extension", lambda: None)
    assert (model.ops is not None) == use_ops
    assert model.decode_chains == (use_ops and chains)
    if calls is not None:
        model.ops = _CallCounter(model.ops)
        calls_seen = model.ops.calls
    cfg = ckpt.config
    stats = RoutingStats(cfg.num_layers, cfg.num_experts)
    kernel, store = make_kernel("fused"), ResidentStore(ckpt)
    model.moe_block = MoeBlock(model.route, kernel, store, NoPrefetch(), stats)
    if use_ops and chains and all(map(ckpt.config.is_moe_layer, range(ckpt.config.num_layers))):
        # a decode step's layers in one call
        model.runner = decide_decode_path("native", model, moe_block=model.moe_block)
    block = 4
    kv = KVCache(cfg.num_layers, 40, block, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 3, 9)]
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    seqs = [list(p) for p in prompts]
    cached = [0] * 4
    out = []

    def step(active, new):
        logits = model.forward(build_forward_batch(new, [cached[i] for i in active], [tables[i] for i in active],
                                                   block, "cpu", cfg.sliding_window), kv)
        for i, tokens, row in zip(active, new, logits):
            cached[i] += len(tokens)
            seqs[i].append(int(row.argmax()))
        out.append(logits)
        routing.append(stats.take_step())

    routing = []

    step([0, 1, 2], [seqs[i] for i in range(3)])  # prefill
    step([0, 1, 2, 3], [seqs[0][-1:], seqs[1][-1:], seqs[2][-1:], seqs[3]])  # mixed
    for _ in range(6):  # decode
        step([0, 1, 2, 3], [seqs[i][-1:] for i in range(4)])
    step([0, 1, 3], [seqs[i][-1:] for i in (0, 1, 3)])  # a smaller batch after them (DecodeLayers' workspaces)
    if calls is not None:
        calls.update(calls_seen)
        # what the steps recorded besides their logits, which must not depend on how they ran
        calls["recorded"] = (routing, stats.load.tolist(), {k: v for k, v in stats.last_topk.items()},
                             kernel.evidence(), store.evidence()["expert_hits"], model.attention_backends)
        calls["decode_steps"] = model.runner.decode_steps
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("name,extra", [("qwen3_e6_k2_norm", {}), ("qwen3_e7_k4", {}),
                                        ("qwen3_e5_k1", {"mlp_only_layers": [0]}),
                                        ("mixtral_e5_k2", {"sliding_window": 6})])
def test_forward_with_step_ops_is_bit_identical(tmp_path, ops, monkeypatch, name, extra):
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path, name, **extra))
    with_ops = _forward_logits(ckpt, True, monkeypatch)
    without = _forward_logits(ckpt, False, monkeypatch)
    assert len(with_ops) == len(without)
    for a, b in zip(with_ops, without):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,extra", [("qwen3_e6_k2_norm", {}), ("qwen3_e7_k4", {}),
                                        ("mixtral_e5_k2", {"sliding_window": 6}),
                                        ("qwen3_e5_k1", {"mlp_only_layers": [0]})])
def test_decode_chains_are_the_ops_one_by_one(tmp_path, ops, monkeypatch, name, extra):
    """The chains compute what the ops they chain compute, called one by one, and record the same
    routing, store look-ups, kernel calls and attention calls; and they do run. Where every layer is
    an MoE layer, a decode step's layers are one call (DecodeLayers); else each decode step's
    attention sub-layer is one call. Every router of few rows is one call."""
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path, name, **extra))
    chained_calls, single_calls = {}, {}
    chained = _forward_logits(ckpt, True, monkeypatch, chains=True, calls=chained_calls)
    single = _forward_logits(ckpt, True, monkeypatch, chains=False, calls=single_calls)
    for a, b in zip(chained, single, strict=True):
        assert torch.equal(a, b)
    assert _same(chained_calls["recorded"], single_calls["recorded"])
    layers, moe_layers = ckpt.config.num_layers, sum(map(ckpt.config.is_moe_layer, range(ckpt.config.num_layers)))
    assert single_calls["decode_steps"] == {"layer-by-layer": 7}
    assert single_calls["decode_attention_block"] == 7 * layers
    assert "decode_attention_sublayer" not in single_calls and "route_decode" not in single_calls
    assert "DecodeLayers" not in single_calls
    if moe_layers == layers:  # the 7 decode steps' layers, each step in one call; routers of the other 2 steps
        assert chained_calls["decode_steps"] == {"native-layers": 7} and chained_calls["DecodeLayers"] == 1
        assert "decode_attention_sublayer" not in chained_calls
        assert chained_calls["route_decode"] == 2 * moe_layers
    else:
        assert chained_calls["decode_steps"] == {"layer-by-layer": 7} and "DecodeLayers" not in chained_calls
        assert chained_calls["decode_attention_sublayer"] == 7 * layers
        assert chained_calls["route_decode"] == 9 * moe_layers  # every step's: at most 28 rows each


def test_decode_layers_checks_the_weights_when_built(tmp_path, ops, monkeypatch):
    """DecodeLayers takes the weights once and checks them then (a step only reads them): a router
    that does not match the hidden size is refused at construction, in one line."""
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path, "qwen3_e6_k2_norm"))
    model = MoeTransformer(ckpt, None)
    cfg = ckpt.config
    model.moe_block = MoeBlock(model.route, make_kernel("fused"), ResidentStore(ckpt), NoPrefetch(),
                               RoutingStats(cfg.num_layers, cfg.num_experts))
    assert decide_decode_path("native", model, moe_block=model.moe_block).name == "native"
    experts = model.moe_block.resident_experts()
    router = ckpt.layers[1].router
    ckpt.layers[1].router = router[:, :-1]
    with pytest.raises(RuntimeError, match="DecodeLayers: router must be"):
        model.native_decode_layers(experts)
    ckpt.layers[1].router = router
    ckpt.layers[1].qkv_proj = ckpt.layers[1].qkv_proj[:-1]  # the step's workspace is sized from layer 0
    with pytest.raises(RuntimeError, match="the first layer's shapes"):
        model.native_decode_layers(experts)


def _same(a, b) -> bool:
    """Equal nested records, tensors compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _torch_routing_summary(steps, num_layers, num_experts):
    """The counting as it was written in torch ops: the reference for the numpy version."""
    load = torch.zeros(num_layers, num_experts, dtype=torch.long)
    out = []
    for calls in steps:
        rows = len(calls)
        flat = torch.cat([ids.flatten() + i * num_experts for i, (_, ids) in enumerate(calls)])
        counts = torch.bincount(flat, minlength=rows * num_experts).view(rows, num_experts)
        load.index_add_(0, torch.tensor([layer for layer, _ in calls]), counts)
        distinct = (counts > 0).sum(1)
        imbalance = counts.max(1).values * distinct / counts.sum(1)
        out.append({"distinct_experts": float(distinct.float().mean()),
                    "expert_imbalance": float(imbalance.float().mean())})
    return out, load


@pytest.mark.parametrize("counting", ["extension", "numpy"])
def test_routing_stats_match_torch_counting(counting, monkeypatch):
    from moebench.engine import moe as routing_stats

    if counting == "numpy":
        monkeypatch.setattr(routing_stats, "_routing_extension", lambda: None)
    elif routing_stats._routing_extension() is None:
        pytest.skip("the CPU extension is not available")
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        num_layers, num_experts = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(2, 70, (1,), generator=g))
        steps = []
        for _ in range(3):
            tokens = int(torch.randint(1, 20, (1,), generator=g))
            k = int(torch.randint(1, min(num_experts, 8) + 1, (1,), generator=g))
            count = int(torch.randint(1, num_layers + 1, (1,), generator=g))
            layers = sorted(torch.randperm(num_layers, generator=g)[:count].tolist())
            if trial % 2:  # tokens differ between calls (not in the engine, but allowed)
                steps.append([(layer, torch.randint(0, num_experts, (tokens + layer % 3, k), generator=g))
                              for layer in layers])
            else:
                steps.append([(layer, torch.randint(0, num_experts, (tokens, k), generator=g)) for layer in layers])
        expect, expect_load = _torch_routing_summary(steps, num_layers, num_experts)
        stats = RoutingStats(num_layers, num_experts)
        for calls, summary in zip(steps, expect):
            for layer, ids in calls:
                stats.record(layer, ids)
            assert stats.take_step() == summary
        assert torch.equal(stats.load, expect_load)
