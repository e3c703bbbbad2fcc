"""The gradient rules of a parallel layout, stated once: what must be completed after backward, and which
rank counts which element of a gradient in the global norm.

Every gradient synchroniser (`parallel.data`: plain, bucketed DP with ZeRO-1/2 shards, FSDP2) and the
pipeline apply exactly these, on whole gradients, on flat shards of them (ZeRO-1/2) or on row shards of
them (ZeRO-3: FSDP2 shards each tp-local tensor by rows over dp, the same rows on every tp rank).

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
import torch.distributed as dist
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


def sum_over_group(grads: list[torch.Tensor], group) -> None:
    """Rule 1: sum `grads` (the same shapes on every rank of `group`) over it, in place, as one all-reduce."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def sum_shared_rows(g: torch.Tensor, shared_rows, group, first: int = 0) -> None:
    """Rule 2 on `g`, rows [first, first + len(g)) of a local gradient (a whole one: first = 0; a ZeRO-3 row
    shard: its first row), in place. `shared_rows` = (local rows, their rows in the compact space common to
    the tp group, its size), as `ColumnParallelLinear.share_rows` declares them. Every rank of `group` must
    call it with the same row range (the same dp coordinate); one all-reduce of the compact space, zeros
    where this rank holds nothing."""
    local, compact, n = shared_rows
    local, compact = local.to(g.device), compact.to(g.device)
    mine = (local >= first) & (local < first + g.shape[0])
    rows, where = local[mine] - first, compact[mine]
    space = g.new_zeros((n, *g.shape[1:]))
    space[where] = g[rows]
    dist.all_reduce(space, group=group)
    g[rows] = space[where]
