"""Parallelism applied from outside a plain model: `parallelize(model, dims, cfg)`.

Each parallelism is one `apply_*` transform in its own module; `parallelize` runs them in a fixed order.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.config import Config
from meshlm.parallel.data import GradSync, apply_data_parallel, microbatches_per_step
from meshlm.parallel.mesh import ParallelDims, destroy, init_distributed
from meshlm.parallel.pipeline import apply_pipeline
from meshlm.parallel.recompute import apply_recompute
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor import LossFn, apply_tensor_parallel, clip_grad_norm_, finish_grads, full_state_dict

__all__ = ["GradSync", "ParallelDims", "TPRNGTracker", "clip_grad_norm_", "destroy", "finish_grads",
           "full_state_dict", "init_distributed", "parallelize"]


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
    4. data parallelism last (`parallel.dp`, `parallel.zero`): its gradient hooks, flat buffers or FSDP2
       shards must hold the final parameters of this rank's stages. The gradient synchronisation (also the
       tp/pp gradient fix-ups and the norm, for any dp) is left at `model.grad_sync`; build the optimizer
       with `model.grad_sync.build_optimizer`.
    """
    if rng is None and dims.tp > 1:  # one TP dropout stream, shared by TP and the recomputation that replays it
        rng = TPRNGTracker(torch.initial_seed(), dims.tp_rank, dims.device)
    loss_fn = apply_tensor_parallel(model, dims, sp=cfg.parallel.sp, rng=rng)
    pipe = apply_pipeline(model, dims, cfg, loss_fn) if dims.pp > 1 else None
    for stage in pipe.modules if pipe is not None else [model]:
        apply_recompute(stage, cfg, rng)
    model.grad_sync = apply_data_parallel(model, dims, cfg, microbatches_per_step(cfg, dims.dp), pipe)
    return loss_fn
