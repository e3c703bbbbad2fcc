"""The gradient rules of a parallel layout, stated once: what must be completed after backward, and which
rank counts which element of a gradient in the global norm.

Every gradient synchroniser (`parallel.data`: plain, bucketed DP with ZeRO-1/2 shards, FSDP2) and the
pipeline apply exactly these, on whole gradients or on flat shards of them.

Completing (after the step's backward passes, before the norm):
1. a parameter marked `sequence_parallel` (norms, row-parallel biases, learned positions under SP) saw
   only this rank's tokens: its gradient is summed over tp;
2. KV rows held by several tp ranks (GQA with tp > n_kv_heads: `ColumnParallelLinear.shared_rows`) are
   summed over the ranks holding each head;
3. a tied embedding held by the first and the last pipeline stage is summed over those two.

Counting in the norm ‖∇‖₂ of the whole model (each element of the unsharded model exactly once):
a. a tp-sharded parameter's rows are counted by the rank holding them, a replicated KV row by its owner;
b. a tp-replicated parameter is counted by tp rank 0;
c. the tied embedding is counted by the first stage only.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.tensor_layers import ColumnParallelLinear, Sharded

ALL, NONE = "all", "none"  # `counted_rows` for every row / no row


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """Rule 1's parameters, in model order."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def shared_row_layers(model: nn.Module) -> list[ColumnParallelLinear]:
    """Rule 2's layers: each has `shared_rows` = (local rows, their rows in a compact space common to the
    tp group, its size) and a weight (and bias) whose those rows are summed over the group."""
    return [m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.shared_rows is not None]


def sharded_row_masks(model: nn.Module) -> dict[int, torch.Tensor | None]:
    """id(parameter) → the rows this rank counts (None: all) for every tp-sharded parameter (rule a)."""
    masks = {}
    for m in model.modules():
        if isinstance(m, Sharded):
            for name in m.sharded_names:
                if getattr(m, name, None) is not None:
                    masks[id(getattr(m, name))] = m.norm_row_mask()
    return masks


def counted_rows(p: torch.Tensor, masks: dict[int, torch.Tensor | None], dims: ParallelDims,
                 pipe=None) -> str | torch.Tensor:
    """Which rows of `p`'s gradient this rank counts in the norm: ALL, NONE or a boolean row mask
    (rules a–c; `masks` from `sharded_row_masks`)."""
    if pipe is not None and pipe.tied_weight is p and not pipe.has_first:
        return NONE
    if dims.tp == 1:
        return ALL
    if id(p) in masks:
        return ALL if masks[id(p)] is None else masks[id(p)]
    return ALL if dims.tp_rank == 0 else NONE


def local_square_sum(params, dims: ParallelDims, pipe=None, model: nn.Module | None = None) -> torch.Tensor:
    """Σ g² over the elements of `params`' gradients this rank counts (before any reduction across ranks),
    in float64. `model`: where the tp-sharded modules are (needed when tp > 1)."""
    masks = sharded_row_masks(model) if model is not None and dims.tp > 1 else {}
    total = torch.zeros((), dtype=torch.float64, device=dims.device)  # a scalar: exact enough, any dtype
    for p in params:
        if p.grad is None:
            continue
        rows = counted_rows(p, masks, dims, pipe)
        if rows is NONE:
            continue
        g = p.grad.to(torch.promote_types(p.grad.dtype, torch.float32))
        total += (g if rows is ALL else g[rows]).pow(2).sum()
    return total


def element_mask(p: torch.Tensor, rows: str | torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor | None:
    """`counted_rows` as a flat mask of p's elements [lo, hi) (None: all), for ZeRO's flat shards."""
    hi = p.numel() if hi is None else hi
    if rows is ALL:
        return None
    if rows is NONE:
        return torch.zeros(hi - lo, dtype=torch.bool, device=p.device)
    return rows.repeat_interleave(p.numel() // p.shape[0])[lo:hi]
