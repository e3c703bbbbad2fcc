"""ZeRO-3 through PyTorch's FSDP2 (`fully_shard` over the dp × cp mesh): parameters, gradients and Adam's
states sharded, each layer gathered when it runs (`parallel/data.py` describes the data-parallel family).

The shards go over every replica of the weights: the dp × cp ranks of one (pp, tp) coordinate
(`ParallelDims.dpcp_mesh`; just dp when cp = 1). Context-parallel ranks hold the same weights and each
one's loss is re-weighted so that the gradient mean over dp × cp is the global batch's
(`parallel/context.py`), which is the mean FSDP2's reduce-scatter takes; shard r (of dp·cp, dp major,
cp minor: `dpcp_rank`) lives on the rank of that index in the group.

With tensor parallelism (tp > 1) FSDP2 shards each rank's *tp-local* tensors (plain tensors, meshlm's own
parallel layers) over its dp × cp group, by rows (dim 0, as `torch.chunk`): the tp ranks of one (dp, cp)
coordinate hold the same rows of their local tensors. FSDP2 reduce-scatters (averages) the gradients over
dp × cp as usual; the tensor-parallel completions of `parallel/grads.py` then run on the reduced row
shards, after backward, over tp only: sums are linear, so summing each averaged shard over tp equals
averaging the tp-summed gradient, and the replicated KV rows of a shard are the same local rows on every
tp rank. The norm counts the shard's rows by the same rules (the row masks sliced to the shard) and sums
over dp × cp, tp and pp. Checkpoints save each rank's row shard as a flat range of its tp-local tensor
(`save_ranges`): the dp × cp shards of one tp rank tile it, so the pieces reassemble under any layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshlm.families.spec import ModelSpec
from meshlm.parallel.data import GradSync, Owned, _flat, _local
from meshlm.parallel.grads import (
    ALL,
    NONE,
    counted_rows,
    sequence_parallel_params,
    sharded_row_masks,
    shared_row_layers,
    sum_over_group,
    sum_shared_rows,
)
from meshlm.parallel.mesh import ParallelDims


class FullyShardedDataParallel(GradSync):
    """ZeRO-3 through FSDP2: each layer, then the model (or each pipeline stage) `fully_shard`ed over dp × cp."""

    zero = 3

    def __init__(self, model: nn.Module, dims: ParallelDims, pipe=None, *, spec: ModelSpec):
        from torch.distributed.fsdp import fully_shard

        super().__init__(model, dims, pipe)
        mesh = dims.dpcp_mesh  # the weights' replicas: dp × cp (the mesh's dp dimension when cp = 1)
        marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
        self.roots = list(pipe.modules) if pipe is not None else [model]
        layers_attr = spec.pipeline.layers
        for root in self.roots:
            for layer in (root.layers if pipe is not None else getattr(root, layers_attr)):
                if layer is not None:
                    fully_shard(layer, mesh=mesh)
            fully_shard(root, mesh=mesh)
        # fully_shard swapped the parameters for new (DTensor) ones. The last stage keeps the first-stage
        # module of the tied weight only to name it (it is not part of the stage): tie it again.
        self.tied = None
        if pipe is not None and pipe.tied_weight is not None:
            first_name, last_name = pipe.tied_names
            if not pipe.has_first:
                owner, _, attr = first_name.rpartition(".")
                setattr(model.get_submodule(owner), attr, model.get_parameter(last_name))
            self.tied = model.get_parameter(first_name)
            pipe.tied_weight = self.tied  # the pipeline's rules (grads.counted_rows) must see the new parameter
        self.names = {id(p): n for n, p in model.named_parameters()}  # now DTensors
        for n, p in model.named_parameters():  # the new parameters lost the mark (`grads.py`, rule 1)
            if n in marked:
                p.sequence_parallel = True
        self.masks = sharded_row_masks(model) if dims.tp > 1 else {}  # rule a, over the new parameters

    def set_last_microbatch(self, last: bool) -> None:
        if self.pipe is None:  # the pipeline schedule toggles FSDP's gradient sync itself
            for root in self.roots:
                root.set_requires_gradient_sync(last)

    def finish(self) -> None:
        """After backward (FSDP2 has reduce-scattered every gradient over dp × cp): the tp completions on this
        rank's row shards (rules 1 and 2), then the tied embedding over (first, last) stage (rule 3)."""
        d = self.dims
        if d.tp > 1:
            sum_over_group([_local(p.grad) for p in sequence_parallel_params(self.model) if p.grad is not None],
                           d.tp_group)
            for m in shared_row_layers(self.model):
                for p in (m.weight, m.bias):
                    if p is not None and p.grad is not None:
                        sum_shared_rows(_local(p.grad), m.shared_rows, d.tp_group, self._first_row(p))
        if self.tied is not None and self.pipe.tied_group is not None:
            dist.all_reduce(_local(self.tied.grad), group=self.pipe.tied_group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        pipe = self.pipe
        grads, total = [], torch.zeros((), dtype=torch.float64, device=self.dims.device)
        for p in self.model.parameters():
            if p.grad is None:
                continue
            g = _local(p.grad)
            grads.append(g)
            rows = counted_rows(p, self.masks, self.dims, pipe)  # rules a-c, over the whole tp-local rows
            if rows is NONE:
                continue
            if rows is not ALL:  # this shard's rows of the mask
                first = self._first_row(p)
                g = g[rows[first:first + g.shape[0]].to(g.device)]
            total += g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum()
        for group, size in ((self.dims.dpcp_group, self.dims.dpcp), (self.dims.tp_group, self.dims.tp),
                            (self.dims.pp_group, self.dims.pp)):
            if size > 1:
                dist.all_reduce(total, group=group)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grads_with_norm_
        if grads:
            torch._foreach_mul_(grads, coef)  # on the local shards (the DTensor gradients' storage)
        return norm

    def _sharded_parameters(self) -> list[torch.Tensor]:
        """The sharded parameters: after a forward without backward (evaluation) FSDP2 may still hold the
        root's gathered ones, so reshard first."""
        for root in self.roots:
            root.reshard()
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        return list(self.model.parameters())

    def _first_row(self, p: torch.Tensor) -> int:
        """The first row (of the tp-local tensor) of this rank's shard of `p` (index `dpcp_rank` of dp × cp):
        FSDP2 shards dim 0 as `torch.chunk` does, so on every tp rank of this (dp, cp) coordinate the same rows."""
        rows = p.shape[0]
        per = -(-rows // self.dims.dpcp)
        return min(self.dims.dpcp_rank * per, rows)

    def _rows(self, p: torch.Tensor) -> Owned:
        local = _local(p)
        lo = self._first_row(p) * (p.numel() // p.shape[0])
        return Owned(self.names[id(p)], tuple(p.shape), lo, lo + local.numel(), local.detach().view(-1), p, _flat)

    def save_ranges(self) -> list[Owned]:
        return [self._rows(p) for p in self._sharded_parameters()]

    def load_weight_ranges(self) -> list[Owned]:
        return self.save_ranges()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        self._sharded_parameters()
        return super().state_bytes(optimizer)
