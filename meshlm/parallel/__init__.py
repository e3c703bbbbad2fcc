"""Parallelism applied from outside a plain model: `parallelize(model, dims, cfg)`.

Each parallelism is one `apply_*` transform in its own module; `parallelize` runs them in a fixed order.
"""

from __future__ import annotations

from torch import nn

from meshlm.config import Config, ConfigError
from meshlm.parallel.mesh import ParallelDims, destroy, init_distributed
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor import LossFn, apply_tensor_parallel, clip_grad_norm_, finish_grads, full_state_dict

__all__ = ["ParallelDims", "TPRNGTracker", "clip_grad_norm_", "destroy", "finish_grads", "full_state_dict",
           "init_distributed", "parallelize"]


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config, rng: TPRNGTracker | None = None) -> LossFn:
    """Transform the whole, seeded `GPT` into this rank's part of the layout; returns the loss to use.

    Order matters:
    1. tensor parallel first: it swaps linears/embeddings for their sharded versions, which every later
       transform (activation recomputation, compile, data-parallel wrapping) must see, not the dense ones.
    (Pipeline cutting, recomputation and data parallelism come after, in their own issues.)
    """
    if dims.pp > 1 or dims.dp > 1:  # until those transforms exist, refuse instead of training replicas
        raise ConfigError(f"this layout has parallel.pp={dims.pp} and parallel.dp={dims.dp}, but only tensor "
                          f"parallelism is implemented so far; launch exactly parallel.tp={dims.tp} processes")
    return apply_tensor_parallel(model, dims, sp=cfg.parallel.sp, rng=rng)
