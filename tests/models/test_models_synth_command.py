"""`moebench models synth --shape ling3-flash-scaled --out DIR`, the README's form, works without
GSM8K data (the bundled tokenizer) and writes every file readable like the rest."""

import os
import stat

from moebench.measuring.run import bundled_model_path


def test_models_synth_without_data_uses_the_bundled_tokenizer(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moebench.models import synth as synth_models
    from moebench.cli.app import app
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from moebench.engine.loader import load_tokenizer

    monkeypatch.delenv("MOEBENCH_GSM8K_DIR", raising=False)
    spec = synth_models.SHAPES["ling3-flash-scaled"]  # narrowed: the real widths take a minute to write
    narrow = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=8)
    monkeypatch.setitem(synth_models.SHAPES, "ling3-flash-scaled", {**spec, "config": {**spec["config"], **narrow}})
    out = tmp_path / "model"
    result = CliRunner().invoke(app, ["models", "synth", "--shape", "ling3-flash-scaled", "--out", str(out),
                                      "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "bundled model's tokenizer" in result.output  # the fallback is said, not silent
    bundled = bundled_model_path()
    assert (out / "tokenizer.json").read_bytes() == (bundled / "tokenizer.json").read_bytes()

    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir() if f.is_file()}
    assert modes["model.safetensors"] == 0o666 & ~umask, modes
    assert set(modes.values()) == {0o666 & ~umask}, modes

    ckpt = load_checkpoint(out)
    tokenizer = load_tokenizer(out)
    assert ckpt.config.vocab_size == tokenizer.get_vocab_size()
    completion = Engine(ckpt, tokenizer, RuntimeConfig(batch_size=1, max_new_tokens=3)).generate(
        [Request("q", "Natalia sold clips to 48 of her friends in April.")]).completions[0]
    assert completion.output_tokens >= 1
