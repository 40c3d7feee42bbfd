"""`--speculative mtp` (engine/mtp.py): the loader reads DeepSeek-V3-style MTP weights
(`num_nextn_predict_layers`, `model.layers.{L}.enorm / hnorm / eh_proj / shared_head.norm` and a
decoder block, dense or routed); the head's paged forward computes what the training module
computes; drafting with the bundled model's trained head gives plain decoding's tokens, greedy and
sampled, with batch > 1, both schedulers, the native decode path, offloaded experts with prefetch
and preemption; a checkpoint without MTP layers is a one-line error; a run that drafted nothing is an
activation error."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.mtp import MtpHead, load_mtp, mtp_layer_count
from moebench.engine.sampling import GREEDY, SamplingParams, request_seed
from moebench.errors import MoebenchError
from moebench.suites import load_suite
from tiny_models import make_tiny_checkpoint

N_ITEMS = 8
MAX_NEW = 48


# ----------------------------------------------------------------------------- loading a DeepSeek-style head


def _deepseek_mtp_tensors(cfg, seed: int, routed: bool, width: int = 20) -> dict:
    """One MTP module in DeepSeek-V3's naming, with the embedding and head copies a DeepSeek
    checkpoint carries under the module (shared with the main model; not read)."""
    g = torch.Generator().manual_seed(seed)
    H, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    p = f"model.layers.{L}."
    t = {"enorm.weight": 1 + r(H), "hnorm.weight": 1 + r(H), "eh_proj.weight": r(H, 2 * H),
         "shared_head.norm.weight": 1 + r(H), "shared_head.head.weight": r(cfg.vocab_size, H),
         "embed_tokens.weight": r(cfg.vocab_size, H),
         "input_layernorm.weight": 1 + r(H), "post_attention_layernorm.weight": 1 + r(H),
         "self_attn.q_proj.weight": r(cfg.num_heads * hd, H), "self_attn.k_proj.weight": r(cfg.num_kv_heads * hd, H),
         "self_attn.v_proj.weight": r(cfg.num_kv_heads * hd, H), "self_attn.o_proj.weight": r(H, cfg.num_heads * hd),
         "self_attn.q_norm.weight": 1 + r(hd), "self_attn.k_norm.weight": 1 + r(hd)}
    if routed:
        I = cfg.moe_intermediate_size
        t["mlp.gate.weight"] = r(cfg.num_experts, H)
        for e in range(cfg.num_experts):
            t.update({f"mlp.experts.{e}.gate_proj.weight": r(I, H), f"mlp.experts.{e}.up_proj.weight": r(I, H),
                      f"mlp.experts.{e}.down_proj.weight": r(H, I)})
    else:
        t.update({"mlp.gate_proj.weight": r(width, H), "mlp.up_proj.weight": r(width, H),
                  "mlp.down_proj.weight": r(H, width)})
    return {p + k: v.contiguous() for k, v in t.items()}


def _with_mtp(directory: Path, tensors: dict) -> Path:
    save_file(tensors, str(directory / "mtp.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return directory


@pytest.mark.parametrize("routed", [False, True])
def test_the_loader_reads_a_deepseek_style_mtp_module(tmp_path, routed):
    plain = load_checkpoint(make_tiny_checkpoint(tmp_path / "m"))
    tensors = _deepseek_mtp_tensors(plain.config, 1, routed)
    ckpt = load_checkpoint(_with_mtp(tmp_path / "m", tensors))
    # the main model is untouched by the extra file
    for a, b in zip(plain.layers, ckpt.layers):
        assert torch.equal(a.qkv_proj, b.qkv_proj) and torch.equal(a.w13, b.w13)
    w = load_mtp(ckpt)
    p = f"model.layers.{plain.config.num_layers}."
    assert w.layer_index == plain.config.num_layers
    assert torch.equal(w.eh_proj, tensors[p + "eh_proj.weight"]) and torch.equal(w.enorm, tensors[p + "enorm.weight"])
    assert torch.equal(w.hnorm, tensors[p + "hnorm.weight"])
    assert torch.equal(w.head_norm, tensors[p + "shared_head.norm.weight"])
    qkv = torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(w.block.qkv_proj, qkv) and torch.equal(w.block.q_norm, tensors[p + "self_attn.q_norm.weight"])
    if routed:
        e = 3
        assert torch.equal(w.block.router, tensors[p + "mlp.gate.weight"])
        assert torch.equal(w.block.w13[e], torch.cat([tensors[p + f"mlp.experts.{e}.gate_proj.weight"],
                                                      tensors[p + f"mlp.experts.{e}.up_proj.weight"]]))
        assert torch.equal(w.block.w2[e], tensors[p + f"mlp.experts.{e}.down_proj.weight"])
    else:
        assert w.block.router is None
        assert torch.equal(w.block.dense_w13, torch.cat([tensors[p + "mlp.gate_proj.weight"],
                                                         tensors[p + "mlp.up_proj.weight"]]))
        assert torch.equal(w.block.dense_w2, tensors[p + "mlp.down_proj.weight"])


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "m"))
    assert mtp_layer_count(ckpt.path) == 0
    engine = Engine(ckpt, None, RuntimeConfig(speculative="mtp"))
    with pytest.raises(MoebenchError, match="no multi-token-prediction layers") as e:
        engine.generate([Request("a", "")], prompt_ids=[[1, 2, 3]])
    assert "\n" not in str(e.value)
    # the field without the tensors: the missing one is named
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(MoebenchError, match="speculative mtp: .*missing tensor 'model.layers.2."):
        load_mtp(load_checkpoint(tmp_path / "m"))


def test_the_head_computes_what_the_training_module_computes(tmp_path):
    """The paged, one-row-per-position forward against train_mtp's batched module on the same weights."""
    from moebench.engine.families import make_cache_and_model
    from moebench.models.train_mtp import MtpModule, save_mtp

    directory = make_tiny_checkpoint(tmp_path / "m")
    cfg = load_checkpoint(directory).config
    c = SimpleNamespace(hidden_size=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps, num_attention_heads=cfg.num_heads,
                        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    torch.manual_seed(0)
    module = MtpModule(c, width=24)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1 if p.dim() == 1 else 0))
        for p in module.parameters():  # save_mtp stores bfloat16: compare on values it keeps
            p.copy_(p.to(torch.bfloat16).float())
    save_mtp(directory, module, cfg.num_layers)
    ckpt = load_checkpoint(directory)
    rt = RuntimeConfig()
    T = 21
    tokens = torch.randint(0, cfg.vocab_size, (T,)).tolist()
    hidden = torch.randn(T, cfg.hidden_size)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    freqs = torch.arange(T, dtype=torch.float)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    with torch.no_grad():
        ref = module(ckpt.embed[tokens][None], hidden[None], emb.cos()[None, None], emb.sin()[None, None])[0]
    backends = set()
    for native in (None, False):  # the block in one native call where it runs, and op by op
        _, _, model = make_cache_and_model(ckpt, rt, 8)
        head = MtpHead(load_mtp(ckpt), model, 8, rt.kv_block_size)
        if native is False:
            head._native = False
        out, logits = head.forward(tokens, hidden, list(range(T)), [list(range(8))] * T)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(logits, ref @ ckpt.lm_head.T, atol=1e-4, rtol=1e-4)
        backends |= set(head.attention_backends)
    if model.ops is not None:  # the extension is built: both of its paths ran
        assert "cpp-native-block" in backends and "cpp-sublayer" in backends, backends


# ----------------------------------------------------------------------------- the engine, tiny model


@pytest.mark.parametrize("scheduler,batch", [("static", 3), ("continuous", 2)])
def test_a_routed_head_drafts_on_a_tiny_model_and_changes_no_output(tmp_path, scheduler, batch):
    directory = make_tiny_checkpoint(tmp_path / "m")
    _with_mtp(directory, _deepseek_mtp_tensors(load_checkpoint(directory).config, 2, routed=True))
    ckpt = load_checkpoint(directory)
    prompts = [[5, 9, 14, 3, 7, 9, 14], [22, 1, 40, 8], [3, 3, 3, 60, 61, 62, 63, 64, 65], [100, 90]]
    outs = {}
    for name, extra in (("off", {}), ("mtp", dict(speculative="mtp", spec_tokens=3))):
        rt = RuntimeConfig(batch_size=batch, scheduler=scheduler, max_new_tokens=20, **extra)
        result = Engine(ckpt, None, rt).generate([Request(str(i), "", 20) for i in range(4)], prompt_ids=prompts)
        assert not result.activation_errors
        outs[name] = [c.output_ids for c in result.completions]
        if name == "mtp":
            ev = result.evidence["speculative"]
            assert ev["drafter"] == "mtp" and ev["drafted"] > 0 and ev["head_forwards"] > 0
            assert ev["drafted_by_position"][2] > 0  # chained drafts ran
    assert outs["mtp"] == outs["off"]


# ----------------------------------------------------------------------------- the bundled model's trained head


@pytest.fixture(scope="module")
def suite():
    return load_suite("gsm-synth", limit=N_ITEMS)


def _generate(checkpoints, tokenizer, suite, sampling=GREEDY, max_new=MAX_NEW, **runtime):
    rt = RuntimeConfig(**{"batch_size": 8, "max_new_tokens": max_new, "offload_tier": "host", **runtime})
    requests = [Request(item.id, suite.prompt(item), max_new, tuple(suite.stop),
                        sampling if sampling.greedy else replace(sampling, seed=request_seed(0, 0, item.id)))
                for item in suite.items]
    return Engine(checkpoints(rt), tokenizer, rt).generate(requests)


SAMPLINGS = {"greedy": GREEDY, "t2": SamplingParams(2.0)}


@pytest.fixture(scope="module")
def plain(checkpoints, tokenizer, suite):
    return {name: _generate(checkpoints, tokenizer, suite, s) for name, s in SAMPLINGS.items()}


def _ids(result):
    return [c.output_ids for c in result.completions]


CONFIGS = {
    "static-8-greedy": (dict(spec_tokens=2), "greedy"),
    "static-8-t2": (dict(spec_tokens=2), "t2"),
    "continuous-3-greedy": (dict(scheduler="continuous", batch_size=3, spec_tokens=3), "greedy"),
    "continuous-3-t2": (dict(scheduler="continuous", batch_size=3, spec_tokens=1), "t2"),
    "fused-native-1-greedy": (dict(kernel="fused", batch_size=1, decode_path="native", spec_tokens=2), "greedy"),
    "offload-lookahead-t2": (dict(kernel="fused", scheduler="continuous", prefetch="lookahead", expert_budget=0.5,
                                  batch_size=4, spec_tokens=2), "t2"),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_mtp_outputs_equal_plain_decoding(checkpoints, tokenizer, suite, plain, config):
    runtime, sampling = CONFIGS[config]
    result = _generate(checkpoints, tokenizer, suite, SAMPLINGS[sampling], speculative="mtp", **runtime)
    assert not result.activation_errors
    assert _ids(result) == _ids(plain[sampling])
    ev = result.evidence["speculative"]
    assert ev["drafter"] == "mtp" and ev["verify_steps"] > 0 and 0 < ev["accepted"] < ev["drafted"]
    assert ev["tokens_per_verify"] > 1.2  # the trained head's drafts are accepted often
    lengths = [n for s in result.steps for n in s["accepted_lengths"]]
    assert [lengths.count(n) for n in range(len(ev["accepted_length_histogram"]))] == ev["accepted_length_histogram"]
    decode = lambda r: sum(s["decode_tokens"] for s in r.steps if s["phase"] != "prefill")  # noqa: E731
    assert decode(result) == decode(plain[sampling])
    if runtime.get("decode_path") == "native":  # the hidden states came out of the one native call
        assert result.evidence["decode_steps"].get("native-layers", 0) > 0


def test_preemption_under_mtp(checkpoints, tokenizer, suite, plain, monkeypatch):
    longest = max(len(tokenizer.encode(suite.prompt(item)).ids) for item in suite.items) + MAX_NEW
    monkeypatch.setattr(Engine, "_kv_blocks", lambda self, seqs: 2 * -(-longest // 4) + 1)
    result = _generate(checkpoints, tokenizer, suite, speculative="mtp", scheduler="continuous", batch_size=4,
                       kv_block_size=4, spec_tokens=3)
    assert result.evidence["scheduler"]["preemptions"] > 0
    assert result.evidence["speculative"]["accepted"] > 0
    assert _ids(result) == _ids(plain["greedy"])


def test_an_mtp_run_that_drafts_nothing_is_an_activation_error(checkpoints, tokenizer, suite):
    result = _generate(checkpoints, tokenizer, suite, speculative="mtp", spec_max_batch=4, max_new=3)  # 8 sequences each step
    ev = result.evidence["speculative"]
    assert ev["drafted"] == 0 and ev["steps_off_by_batch"] > 0
    assert ev["head_rows"] > 0  # the head still caught up on every kept position
    assert any("speculative mtp: no token was drafted" in e for e in result.activation_errors)
