"""Parallelism applied from outside a plain model: `parallelize(model, dims, cfg)`.

Each parallelism is one `apply_*` transform in its own module; `parallelize` runs them in a fixed order.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.config import Config, ConfigError
from meshlm.parallel.mesh import ParallelDims, destroy, init_distributed
from meshlm.parallel.pipeline import apply_pipeline
from meshlm.parallel.recompute import apply_recompute
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor import LossFn, apply_tensor_parallel, clip_grad_norm_, finish_grads, full_state_dict

__all__ = ["ParallelDims", "TPRNGTracker", "clip_grad_norm_", "destroy", "finish_grads", "full_state_dict",
           "init_distributed", "parallelize"]


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config, rng: TPRNGTracker | None = None) -> LossFn:
    """Transform the whole, seeded `GPT` into this rank's part of the layout; returns the loss to use.

    Order matters:
    1. tensor parallel first: it swaps linears/embeddings for their sharded versions, which every later
       transform (activation recomputation, compile, data-parallel wrapping) must see, not the dense ones.
    2. pipeline cutting (`parallel.pp` > 1): it groups the (parallel) modules into this rank's stages and
       prunes the rest; the schedule is left at `model.pipeline`. Before recomputation, whose chunks and
       `block` counts are per stage, as in Megatron.
    3. activation recomputation next (`train.recompute`): it wraps the parallel layers' forwards (full) or
       attention core (selective), so a recomputed region replays the sharded computation, its collectives
       and the TP dropout stream; before compile, which must trace the checkpoint regions, and before
       data-parallel wrapping, which must see the final modules.
    (Data parallelism comes in its own issue.)
    """
    if dims.dp > 1:  # until that transform exists, refuse instead of training replicas
        raise ConfigError(f"this layout has parallel.dp={dims.dp}, but data parallelism is not implemented so far; "
                          f"launch exactly parallel.tp × parallel.pp = {dims.tp * dims.pp} processes")
    if rng is None and dims.tp > 1:  # one TP dropout stream, shared by TP and the recomputation that replays it
        rng = TPRNGTracker(torch.initial_seed(), dims.tp_rank, dims.device)
    loss_fn = apply_tensor_parallel(model, dims, sp=cfg.parallel.sp, rng=rng)
    stages = apply_pipeline(model, dims, cfg, loss_fn).modules if dims.pp > 1 else [model]
    for stage in stages:
        apply_recompute(stage, cfg, rng)
    return loss_fn
