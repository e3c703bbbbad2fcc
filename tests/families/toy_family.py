"""The toy family's families/ module: its `ModelSpec`, registered as `model.family = "toy-encoder"`.

With its model file (`toy_model.py`) this is all a new family takes: it trains through the same `Trainer`,
`parallel.build_model` and checkpoints as GPT, the proof that `parallel/` and `train/` need no GPT name.
Importing this module registers the family (spawned test workers import it too).
"""

from __future__ import annotations

import torch
from toy_model import ToyEncoder, init_rule

from meshlm.core.config import ModelConfig
from meshlm.data import build_datasets
from meshlm.families.common import check_tp
from meshlm.families.registry import register
from meshlm.families.spec import ModelSpec, PipelinePlan
from meshlm.families.styles import ColumnParallel, HeadParallelAttention, RowParallel, SequenceParallel, VocabParallel
from meshlm.models.loss import cross_entropy


def tp_plan(cfg: ModelConfig) -> dict:
    return {"words": VocabParallel(), "blocks.*.attn": HeadParallelAttention(qkv="in_proj", proj="out_proj"),
            "blocks.*.ln[12]": SequenceParallel(), "blocks.*.up": ColumnParallel(), "blocks.*.down": RowParallel(),
            "out": ColumnParallel(vocab_of="words")}


def _count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in ToyEncoder(cfg).parameters())


def _flops(cfg: ModelConfig, batch: int, seq_len: int | None = None) -> float:
    return 6.0 * _count(cfg) * batch * (seq_len or cfg.seq_len)


def _datasets(cfg, progress: bool = False):
    return build_datasets(cfg, progress=progress)  # the bundled corpus; each position predicts the next token


TOY_SPEC = register(ModelSpec(
    name="toy-encoder", model_class=ToyEncoder, tp_plan=tp_plan, check_tensor_parallel=check_tp,
    pipeline=PipelinePlan(first=("words",), layers="blocks", last=("out",)), selective_recompute=("attn.core",),
    init_rule=init_rule, logical_blocks=lambda name, cfg: [(name, -1)], loss=cross_entropy, fused_loss=False,
    flops=_flops, recompute_flops=lambda cfg, batch, mode, seq_len=None, layers=None: 0.0,
    stage_costs=lambda cfg: (0.0, 0.0), parameter_count=_count, activation_bytes=None, build_datasets=_datasets))
