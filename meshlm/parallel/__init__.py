"""Parallelism applied from outside a plain model: `parallelize(model, dims, cfg)`.

Each parallelism is one `apply_*` transform in its own module; `parallelize` runs them in a fixed order.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.config import Config, ConfigError
from meshlm.parallel.mesh import ParallelDims, destroy, init_distributed
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
    2. activation recomputation next (`train.recompute`): it wraps the parallel layers' forwards (full) or
       attention core (selective), so a recomputed region replays the sharded computation, its collectives
       and the TP dropout stream; before compile, which must trace the checkpoint regions, and before
       data-parallel wrapping, which must see the final modules.
    (Pipeline cutting and data parallelism come in their own issues.)
    """
    if dims.pp > 1 or dims.dp > 1:  # until those transforms exist, refuse instead of training replicas
        raise ConfigError(f"this layout has parallel.pp={dims.pp} and parallel.dp={dims.dp}, but only tensor "
                          f"parallelism is implemented so far; launch exactly parallel.tp={dims.tp} processes")
    if rng is None and dims.tp > 1:  # one TP dropout stream, shared by TP and the recomputation that replays it
        rng = TPRNGTracker(torch.initial_seed(), dims.tp_rank, dims.device)
    loss_fn = apply_tensor_parallel(model, dims, sp=cfg.parallel.sp, rng=rng)
    apply_recompute(model, cfg, rng)
    return loss_fn
