"""Train a multi-token-prediction head for the bundled model (`moebench train-bundled --mtp`).

The base model is frozen; the head is a DeepSeek-V3-style MTP module (engine/mtp.py has its layout
and inference): enorm, hnorm, eh_proj (2H -> H), one decoder block with the base's attention shape
and a dense SwiGLU MLP (DeepSeek-V3's block routes experts; a dense one keeps the head at about a
megabyte, and the engine reads both), shared_head.norm, and the base's tied embedding as both its
input embedding and its LM head. At position t it reads the base's final-normed hidden state h_t and
the token x_{t+1} and is trained to predict x_{t+2} as the base model would: the loss is the cross
entropy against the base's own next-token distribution at position t + 1 (distillation), over the
positions whose x_{t+2} lies in the answer. What speculative decoding needs is agreement with the
base's pick, so that is what the head learns and what the log reports ("agree": the head's argmax
equals the base's, the offline estimate of draft position 1's acceptance under greedy decoding).

The weights are written as `mtp.safetensors` (bfloat16, `model.layers.{num_hidden_layers}.*`) beside
the checkpoint's own files, and config.json gets `num_nextn_predict_layers: 1`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from moebench.models.train import BUNDLED_DIR, batches, hf_config
from moebench.models.train_model import Attention, RMSNorm, TrainModel

MTP_WIDTH = 512  # the head's dense MLP width (the base's intermediate_size)


class DenseMlp(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SharedHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MtpModule(nn.Module):
    """Parameter names are the checkpoint's, below `model.layers.{L}.`."""

    def __init__(self, c, width: int = MTP_WIDTH):
        super().__init__()
        H, eps = c.hidden_size, c.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn = Attention(c)
        self.mlp = DenseMlp(H, width)
        self.shared_head = SharedHead(c)

    def forward(self, emb, hidden, cos, sin):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)


def load_base(path: Path) -> TrainModel:
    """The bundled checkpoint's weights (bfloat16 on disk, float32 here) in the training model, frozen."""
    from safetensors.torch import load_file

    cfg_raw = json.loads((path / "config.json").read_text())
    model = TrainModel(hf_config(cfg_raw["vocab_size"]))
    sd = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    E = cfg_raw.get("num_experts", cfg_raw.get("num_local_experts"))
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            state[name] = torch.stack([torch.cat([sd[f"{pre}{e}.gate_proj.weight"], sd[f"{pre}{e}.up_proj.weight"]])
                                       for e in range(E)])
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            state[name] = torch.stack([sd[f"{pre}{e}.down_proj.weight"] for e in range(E)])
        else:
            state[name] = sd[name]
    model.load_state_dict(state)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def rope(model: TrainModel, length: int):
    fr = torch.arange(length, dtype=torch.float)[:, None] * model.inv_freq[None, :]
    emb = torch.cat((fr, fr), dim=-1)
    return emb.cos()[None, None], emb.sin()[None, None]


@torch.no_grad()
def base_forward(model: TrainModel, ids, valid):
    """(final-normed hidden states [B, T, H], logits [B, T, V]) of the frozen base."""
    x = model.model.embed_tokens(ids)
    cos, sin = rope(model, ids.shape[1])
    for layer in model.model.layers:
        x, _, _ = layer(x, cos, sin, valid.reshape(-1))
    h = model.model.norm(x)
    return h, F.linear(h, model.model.embed_tokens.weight)


def mtp_loss(head: MtpModule, base: TrainModel, ids, labels, valid):
    """(distillation loss, data cross entropy, agreement with the base's argmax, positions) of one batch."""
    h, base_logits = base_forward(base, ids, valid)
    T = ids.shape[1]
    cos, sin = rope(base, T - 1)
    emb = base.model.embed_tokens(ids[:, 1:])  # x_{t+1} for t = 0..T-2
    out = head(emb, h[:, :-1], cos, sin)
    logits = F.linear(out, base.model.embed_tokens.weight)  # [B, T-1, V]: x_{t+2}
    target = base_logits[:, 1:]  # the base's distribution of x_{t+2} (at position t + 1)
    data = labels[:, 1:]  # x_{t+2} where it is an answer token
    mask = data != -100
    logp = torch.log_softmax(logits[mask], dim=-1)
    loss = -(torch.softmax(target[mask], dim=-1) * logp).sum(-1).mean()
    ce = F.nll_loss(logp, data[mask])
    agree = (logits[mask].argmax(-1) == target[mask].argmax(-1)).float().mean()
    return loss, ce, agree, int(mask.sum())


def init_head(head: MtpModule, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.normal_(0.0, std, generator=g)


def train_mtp(out: Path, base_dir: Path = BUNDLED_DIR, minutes: float = 16.0, seed: int = 0, steps: int = 1500,
              batch_size: int = 16, lr: float = 2e-3, threads: int = 1, log=print) -> dict:
    """Train the head on gsm-synth training problems (the base's held-out validation questions and
    the test split excluded, as for the base) and write it into `out` (a copy of `base_dir` unless
    they are the same folder)."""
    from tokenizers import Tokenizer

    from moebench.suites.synth import generate_split

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out, base_dir = Path(out), Path(base_dir)
    if out.resolve() != base_dir.resolve():
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"):
            if (base_dir / f).exists():
                shutil.copy2(base_dir / f, out / f)
    base = load_base(base_dir)
    c = base.c
    head = MtpModule(c)
    init_head(head, seed)
    nparams = sum(p.numel() for p in head.parameters())
    log(f"mtp head: {nparams / 1e6:.3f}M params (dense MLP width {MTP_WIDTH}), base frozen from {base_dir}")
    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    tok.no_padding()  # the saved tokenizer pads batches (left, for generate); training rows are unpadded
    tok.no_truncation()
    val = generate_split("train", 100, seed=seed + 999)
    data = batches(tok, random.Random(seed + 7), batch_size, {p.question for p in val}, seed + 31)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = min(50, steps // 10)
    t0 = time.time()
    ema = ema_agree = None
    step = 0
    for step in range(steps):
        progress = max(step / steps, (time.time() - t0) / (minutes * 60))
        if progress >= 1.0:
            log(f"time budget of {minutes} min reached at step {step}; stopping")
            break
        f = 0.0 if step < warmup else min(1.0, progress)
        for group in opt.param_groups:
            group["lr"] = lr * (step + 1) / warmup if step < warmup else lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))
        ids, labels, valid = next(data)
        loss, ce, agree, n = mtp_loss(head, base, ids, labels, valid)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        ema_agree = agree.item() if ema_agree is None else 0.95 * ema_agree + 0.05 * agree.item()
        if step % 50 == 0:
            log(f"step {step} loss {loss.item():.4f} ema {ema:.4f} data-ce {ce.item():.4f} agree {agree.item():.3f} "
                f"ema-agree {ema_agree:.3f} elapsed {(time.time() - t0) / 60:.1f}m")
    nsteps = step + 1 if step + 1 == steps else step
    with torch.no_grad():  # one batch of 100 problems from a problem stream of its own (not the training stream)
        vdata = batches(tok, random.Random(seed + 11), len(val), set(), seed + 999)
        vloss, vce, vagree, vn = mtp_loss(head, base, *next(vdata))
    result = {"steps": nsteps, "train_minutes": round((time.time() - t0) / 60, 1), "params": nparams,
              "final_loss_ema": round(ema, 4), "final_agree_ema": round(ema_agree, 4),
              "check_batch_loss": round(vloss.item(), 4), "check_batch_data_ce": round(vce.item(), 4),
              "check_batch_agree": round(vagree.item(), 4), "check_batch_positions": vn, "seed": seed,
              "command": f"moebench train-bundled --mtp --mtp-steps {steps} --mtp-minutes {minutes:g} --seed {seed}"}
    log(f"separate stream ({vn} answer positions): loss {vloss.item():.4f}, data ce {vce.item():.4f}, "
        f"agreement with the base's argmax {vagree.item():.3f}")
    save_mtp(out, head, c.num_hidden_layers)
    (out / "mtp_train_result.json").write_text(json.dumps(result, indent=1) + "\n")
    log(f"saved {out / 'mtp.safetensors'}")
    return result


def save_mtp(out: Path, head: MtpModule, num_layers: int) -> None:
    from safetensors.torch import save_file

    from moebench.engine.mtp import CONFIG_FIELD

    prefix = f"model.layers.{num_layers}."
    tensors = {prefix + k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg[CONFIG_FIELD] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
