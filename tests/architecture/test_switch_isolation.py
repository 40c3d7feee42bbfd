"""A switch changes exactly what its name says: flipping one leaves every other setting a run
records (the decode path and its threads, the expert store's kind, dtype, rows, bytes and loaders)
as it was. The real engine on the bundled model, each setting read from the run's own evidence."""

import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.errors import MoebenchError

BASE = {"kernel": "naive", "scheduler": "static", "prefetch": "off", "decode_path": "auto"}
FLIPS = {"kernel": "fused", "scheduler": "continuous", "prefetch": "lookahead", "decode_path": "eager"}
STORE_KEYS = ("store", "expert_dtype", "slots_per_layer", "rows", "rows_per_layer", "expert_pool_bytes",
              "tier", "tier_dtype", "pinned", "load_workers", "native_loader", "loader_cpus")


@pytest.fixture(scope="module")
def ckpt():
    from moebench.measuring.run import bundled_model_path

    # as `moebench run` loads it for an offloaded run: experts in the file's dtype
    return load_checkpoint(bundled_model_path(), dtype=torch.float32, experts_in_checkpoint_dtype=True)


def run(ckpt, budget, **switches):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    rt = RuntimeConfig(batch_size=2, max_new_tokens=6, expert_budget=budget, offload_tier="host",
                       **{**BASE, **switches})
    lengths = [2, 6, 4, 5]  # requests that finish apart, so a continuous scheduler admits some mid-batch
    result = Engine(ckpt, None, rt).generate([Request(f"r{i}", "", n) for i, n in enumerate(lengths)],
                                             prompt_ids=prompts)
    assert result.activation_errors == []
    return result


def settings(result) -> dict:
    """What a run recorded about how it ran, beside what its switches are for."""
    store, path = result.evidence["prefetch"], result.evidence["decode_path"]
    return {"decode_path": (path["path"], path["chains"], path["step_pool"]),
            "threads": sorted(path["decode_threads"]),
            "streamed_dots": (path["streamed_dots"] or {}).get("kernel"),
            "stream_run_bytes": (path["streamed_dots"] or {}).get("stream_run_bytes"),
            "store": {k: store.get(k) for k in STORE_KEYS}}


@pytest.mark.parametrize("budget", [0.5, 1.0])
def test_flipping_a_switch_leaves_every_other_setting(ckpt, budget):
    base = settings(run(ckpt, budget))
    assert base["threads"], "decode steps ran and recorded their threads"
    from moebench.kernels.cpu_moe import load_extension

    if load_extension() is not None:  # the streamed dots' kernel, as the extension reported it
        assert base["streamed_dots"] == load_extension().simd_stats()["streams"]
    for switch, value in FLIPS.items():
        if switch == "prefetch" and budget == 1.0:
            continue  # every expert resident: nothing to prefetch, which the run reports as a failure
        flipped = settings(run(ckpt, budget, **{switch: value}))
        own = {"decode_path": ("decode_path", "threads")}.get(switch, ())
        for key in base:
            if key not in own:
                assert flipped[key] == base[key], f"{switch}={value} changed {key}"
        if switch == "decode_path":  # and it does change what it names
            assert flipped["decode_path"][0] == "eager" and base["decode_path"][0] != "eager"


def test_native_decode_path_is_its_own_choice(ckpt):
    """The whole step in one native call runs when asked for, for kernel=fused on resident experts;
    asked for where its MoE op cannot run, it is refused before the run, not quietly replaced."""
    from moebench.engine.model import cpu_step_ops

    if cpu_step_ops() is None:
        pytest.skip("needs the C++ extension")
    native = run(ckpt, 1.0, kernel="fused", decode_path="native")
    chained = run(ckpt, 1.0, kernel="fused")
    assert set(native.evidence["decode_steps"]) == {"native-layers"}
    assert set(chained.evidence["decode_steps"]) == {"layer-by-layer"}
    assert [c.output_ids for c in native.completions] == [c.output_ids for c in chained.completions]
    assert settings(native)["store"] == settings(chained)["store"]
    for switches in ({"kernel": "naive"}, {"kernel": "fused", "prefetch": "lookahead"}):
        with pytest.raises(MoebenchError, match="decode path 'native' cannot run"):
            run(ckpt, 1.0, decode_path="native", **switches)
    with pytest.raises(MoebenchError, match="leaves experts out of memory"):
        run(ckpt, 0.5, kernel="fused", decode_path="native")
