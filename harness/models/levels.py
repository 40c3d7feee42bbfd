"""The levels of the synthetic suite that moebench bundles a model for: which suite module trains and
scores each, the model's shape, and where its bundle lives. `moebench train-bundled --level` picks one."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from moebench.models.bundled import BUNDLED_HARD_MODEL, BUNDLED_MODEL

# The easy level's shape (the bundled default, gsm-synth-moe).
EASY_CONFIG = dict(
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    intermediate_size=512,          # unused: every layer is sparse
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    router_aux_loss_coef=0.01,
    hidden_act="silu",
)
# The hard level reads stories of 2-3 people over prompts ~2.3x longer; its shape is the easy one's
# (the training budget, not the width, is what bounds it on 2 cores: docs/gsm-synth-hard.md).
HARD_CONFIG = dict(EASY_CONFIG)


@dataclass(frozen=True)
class Level:
    name: str            # --level
    suite: str           # the suite's name as --suite takes it
    module: str          # the module that generates its problems (iter_problems, generate_split)
    bundled: Path        # the bundle moebench ships for it
    model_config: dict = field(default_factory=dict)
    numbers: str = ""    # the module's number ranges to train on (its default where empty)

    def problems(self) -> ModuleType:
        return importlib.import_module(self.module)

    def generator_kwargs(self) -> dict:
        return {"nums": getattr(self.problems(), self.numbers)} if self.numbers else {}


LEVELS = {
    "easy": Level("easy", "gsm-synth", "moebench.suites.synth", BUNDLED_MODEL, EASY_CONFIG),
    "hard": Level("hard", "gsm-synth-hard", "moebench.suites.synth_hard", BUNDLED_HARD_MODEL, HARD_CONFIG),
    # the hard level's stories with its wider numbers (synth_hard.WIDE): the first stage of its model
    "hard-wide": Level("hard-wide", "gsm-synth-hard", "moebench.suites.synth_hard", BUNDLED_HARD_MODEL, HARD_CONFIG,
                       numbers="WIDE"),
}
