"""ZeRO-3 through PyTorch's FSDP2 (`fully_shard` over the dp mesh): parameters, gradients and Adam's states
sharded, each layer gathered when it runs (`parallel/data.py` describes the data-parallel family)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshlm.families.spec import ModelSpec
from meshlm.parallel.data import GradSync, Owned, _flat, _local
from meshlm.parallel.grads import NONE, counted_rows
from meshlm.parallel.mesh import ParallelDims


class FullyShardedDataParallel(GradSync):
    """ZeRO-3 through FSDP2: each layer, then the model (or each pipeline stage) `fully_shard`ed over dp."""

    zero = 3

    def __init__(self, model: nn.Module, dims: ParallelDims, pipe=None, *, spec: ModelSpec):
        from torch.distributed.fsdp import fully_shard

        super().__init__(model, dims, pipe)
        mesh = dims.mesh["dp"]
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

    def set_last_microbatch(self, last: bool) -> None:
        if self.pipe is None:  # the pipeline schedule toggles FSDP's gradient sync itself
            for root in self.roots:
                root.set_requires_gradient_sync(last)

    def finish(self) -> None:
        if self.tied is not None and self.pipe.tied_group is not None:
            dist.all_reduce(_local(self.tied.grad), group=self.pipe.tied_group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        pipe = self.pipe
        grads, total = [], torch.zeros((), dtype=torch.float64, device=self.dims.device)
        for p in self.model.parameters():
            if p.grad is None:
                continue
            grads.append(_local(p.grad))
            if counted_rows(p, {}, self.dims, pipe) is not NONE:  # tp = 1 under FSDP2: rule c only
                total += grads[-1].to(torch.promote_types(grads[-1].dtype, torch.float32)).pow(2).sum()
        dist.all_reduce(total, group=self.dims.dp_group)
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.pp_group)
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

    def _rows(self, p: torch.Tensor) -> Owned:
        local = _local(p)
        rows = p.shape[0]
        per = -(-rows // self.dims.dp)  # FSDP2 shards dim 0 as torch.chunk does
        first = min(self.dims.dp_rank * per, rows)
        lo = first * (p.numel() // rows)
        return Owned(self.names[id(p)], tuple(p.shape), lo, lo + local.numel(), local.detach().view(-1), p, _flat)

    def save_ranges(self) -> list[Owned]:
        return [self._rows(p) for p in self._sharded_parameters()]

    def load_weight_ranges(self) -> list[Owned]:
        return self.save_ranges()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        self._sharded_parameters()
        return super().state_bytes(optimizer)
