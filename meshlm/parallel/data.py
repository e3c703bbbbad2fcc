"""Data parallelism: gradients averaged over the dp group while backward still runs, and the distributed
optimizer (ZeRO stages 1, 2 and 3).

Our own bucketed reducer, not `DistributedDataParallel`. DDP wraps a module and expects one forward then
one backward per reduction; around a `PipelineStage` it crashes, or with `static_graph=True` trains with
wrong gradients (verified; docs/architecture.md), because the schedule interleaves forwards and backwards
of several micro-batches. What we need is small: each parameter gets a post-accumulate-grad hook
(`Tensor.register_post_accumulate_grad_hook`) that counts the backward passes of the step; when every
parameter of a bucket has seen its last micro-batch, the bucket's flat gradient buffer is reduced
asynchronously over dp while backward goes on with earlier layers. This works unchanged for the plain
accumulation loop, for the 1F1B/interleaved schedules and for activation recomputation, since all of
them end in the parameter's AccumulateGrad node exactly once per micro-batch. Non-final micro-batches
never communicate.

Buckets hold parameters in reverse model order (roughly the order backward finishes them), about
`parallel.bucket_mb` MiB each, and are launched strictly in bucket order so every dp rank issues the same
collectives in the same order. The pipeline's tied embedding gets a bucket of its own, so its shard
boundaries are the same on the first and the last stage. Gradients live in the flat buffers (each
`p.grad` is a view), summed over dp and divided by dp: with m local micro-batches each averaging its loss
over m, the result is the mean over the global batch, as in one process.

ZeRO (Rajbhandari et al. 2020; Megatron's distributed optimizer), `parallel.zero`:
* 0: every dp rank holds the whole optimizer; buckets are all-reduced.
* 1: each bucket is split into dp equal shards; rank r keeps Adam's states for shard r only, steps it
  (its AdamW sees 1-D views of the flat parameter buffer, with the same weight-decay groups), then the
  updated shards are all-gathered into every rank's parameters. Buckets are all-reduced.
* 2: as 1, but buckets are reduce-scattered: after the reduction a rank holds only its gradient shard
  (the full-size buffer lives during backward only). The fix-ups tensor and pipeline parallelism apply
  after backward (sequence-parallel sums, replicated KV heads, tied embedding) run on the shards, whose
  element ranges are the same on every tp rank (same shapes) and on both tied stages (own bucket).
* 3: PyTorch's FSDP2 `fully_shard(..., mesh=dp_mesh)` on each layer and on the model or each pipeline
  stage: parameters, gradients and states sharded, gathered per layer for compute.
Gradient norms under ZeRO sum the squares of each rank's shard (each element counted once across the
whole layout) and all-reduce them over dp, tp and pp.

Memory per parameter for model states (FORMULAS.md). meshlm keeps fp32 parameters, which serve as the
master weights, and autocasts per op for bf16: there is no separate 16-bit weight copy, so both fp32 and
bf16 runs hold 4 (weights) + 4 (gradients) + 8 (Adam m, v) = 16 B/param, 8 + 8/d with ZeRO-1,
4 + 12/d with ZeRO-2 (between steps; the local gradients are whole during backward) and 16/d with
ZeRO-3 (plus one layer's gathered weights while it runs). Megatron's 18 and 6 + 12/d count a 16-bit
weight copy beside fp32 masters, which meshlm does not have. `state_bytes` measures what is allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import Config
from meshlm.parallel.grads import (
    NONE,
    counted_rows,
    element_mask,
    sequence_parallel_params,
    sharded_row_masks,
    shared_row_layers,
)
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.tensor import _ALL_GATHER, _REDUCE_SCATTER, finish_grads
from meshlm.parallel.tensor import clip_grad_norm_ as tp_clip_grad_norm_
from meshlm.plan.layout import check_data_parallel, microbatches_per_step  # noqa: F401 (re-exported)

ParamGroups = list[dict]  # torch.optim param groups over the model's parameters
MakeOptimizer = Callable[[ParamGroups], torch.optim.Optimizer]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard; a plain tensor itself)."""
    return getattr(t, "_local_tensor", t)


@dataclass
class Owned:
    """A flat range [lo, hi) of one (tp/pp-local) parameter held by this rank, for checkpoints.

    `weight` is the 1-D view of those weights; `opt_key` the tensor the optimizer keys the range's state
    by; `opt_flat` maps one of its state tensors to the 1-D values of the range.
    """

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    weight: torch.Tensor
    opt_key: torch.Tensor
    opt_flat: Callable[[torch.Tensor], torch.Tensor]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return _local(t).reshape(-1)


class GradSync:
    """No data parallelism (dp = 1): the tensor/pipeline gradient fix-ups, the norm and a plain AdamW.

    The trainer's step is the same for every layout:
    backward passes → `finish()` → `clip_grad_norm_()` → optimizer step → `after_step()` → `zero_grad()`.
    """

    zero = 0

    def __init__(self, model: nn.Module, dims: ParallelDims, pipe=None):
        self.model, self.dims, self.pipe = model, dims, pipe
        self.names = {id(p): n for n, p in model.named_parameters()}  # plain names, each tensor once

    def set_last_microbatch(self, last: bool) -> None:
        """Called before each backward of the accumulation loop (ZeRO-3 only reduces on the last)."""

    def finish(self) -> None:
        """After the step's backward passes: complete the gradients (reductions, tp and pp fix-ups)."""
        finish_grads(self.model, self.dims)
        if self.pipe is not None:
            self.pipe.finish_grads()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """‖∇‖₂ of the whole model, and the gradients scaled to at most `max_norm`."""
        if self.pipe is not None:
            return self.pipe.clip_grad_norm_(self.model, max_norm)
        if self.dims.tp > 1:
            return tp_clip_grad_norm_(self.model, self.dims, max_norm)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def build_optimizer(self, groups: ParamGroups, make: MakeOptimizer) -> torch.optim.Optimizer:
        """`make(groups)`, with `groups` (over the model's parameters, e.g. weight-decay groups) mapped to
        what this rank steps: the parameters themselves, or under ZeRO its shards of them."""
        return make(groups)

    def after_step(self) -> None:
        """After the optimizer step (ZeRO-1/2: all-gather the updated parameter shards)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def average_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's mean micro-batch loss → the global batch's (the mean over dp)."""
        if self.dims.dp == 1:
            return loss
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.dims.dp_group)
        return total / self.dims.dp

    # ---- what this rank holds, for checkpoints -------------------------------------------------------
    def _whole(self, p: torch.Tensor) -> Owned:
        return Owned(self.names[id(p)], tuple(p.shape), 0, p.numel(), p.detach().view(-1), p, _flat)

    def save_ranges(self) -> list[Owned]:
        """The ranges whose weights and optimizer states this rank writes (each dp replica once)."""
        return [self._whole(p) for p in self.model.parameters()] if self.dims.dp_rank == 0 else []

    def load_weight_ranges(self) -> list[Owned]:
        """The ranges of parameters this rank must read back."""
        return [self._whole(p) for p in self.model.parameters()]

    def load_state_ranges(self) -> list[Owned]:
        """The ranges of optimizer state this rank's optimizer holds."""
        return self.load_weight_ranges()

    # ---- memory ----------------------------------------------------------------------------------------
    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes allocated for parameters, gradients and optimizer states on this rank (each storage once,
        padding included); measure after an optimizer step, before `zero_grad`."""
        params = list(self.model.parameters())
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        grads = [p.grad for p in params + opt_params]
        return {"params": _storage_bytes(params + opt_params), "grads": _storage_bytes(grads),
                "optim": _storage_bytes(states), "n_params": sum(p.numel() for p in params)}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def theory_bytes_per_param(zero: int, dp: int) -> float:
    """Model-state bytes per parameter with fp32 weights (= master weights) and Adam, over dp ranks."""
    return {0: 16.0, 1: 8 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}[zero]


def memory_report(sync: GradSync, optimizer: torch.optim.Optimizer) -> str:
    """One line for rank 0's log (a collective over the world: the largest rank's total is included)."""
    b = sync.state_bytes(optimizer)
    total = b["params"] + b["grads"] + b["optim"]
    worst = torch.tensor([float(total)])
    if dist.is_initialized() and sync.dims.world_size > 1:
        worst = worst.to(sync.dims.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    mib = 2.0 ** 20
    zero, dp = sync.zero, sync.dims.dp
    formula = {0: "16", 1: f"8 + 8/{dp}", 2: f"4 + 12/{dp}", 3: f"16/{dp}"}[zero]
    return (f"model states, rank 0: params {b['params'] / mib:.2f} + grads {b['grads'] / mib:.2f} + optimizer "
            f"{b['optim'] / mib:.2f} = {total / mib:.2f} MiB for {b['n_params']:,} parameters = "
            f"{total / max(1, b['n_params']):.2f} B/param (theory, ZeRO-{zero} over dp={dp}, fp32 weights as "
            f"master weights: {formula} = {theory_bytes_per_param(zero, dp):.2f} B/param); largest rank "
            f"{float(worst) / mib:.2f} MiB")


# ---- ZeRO 0-2: our bucketed reducer -------------------------------------------------------------------------
@dataclass
class Bucket:
    params: list[nn.Parameter]
    starts: list[int]  # offset of each parameter in the flat buffers
    numel: int  # padded to a multiple of dp
    shard: tuple[int, int]  # this dp rank's [lo, hi) of the flat buffers
    grad: torch.Tensor | None = None  # full-size gradients (ZeRO-2: during backward only)
    shard_grad: torch.Tensor | None = None  # ZeRO-2: the reduced shard
    param_buf: torch.Tensor | None = None  # ZeRO-1/2: the parameters, flat (each p.data is a view)
    waiting: int = 0  # parameters that have not yet seen the step's last micro-batch
    work: object = None  # the pending collective


class BucketedDataParallel(GradSync):
    """ZeRO 0, 1 or 2 over dp > 1 with our bucketed, backward-overlapped reduction (module docstring)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, microbatches: int, zero: int = 0, pipe=None,
                 bucket_mb: float = 25.0, overlap: bool = True):
        super().__init__(model, dims, pipe)
        self.zero, self.microbatches, self.overlap = zero, microbatches, overlap
        self.group, self.dp = dims.dp_group, dims.dp
        params = [p for p in model.parameters() if p.requires_grad]
        if len({p.dtype for p in params}) > 1:
            raise ValueError("data parallelism needs parameters of one dtype (meshlm keeps them fp32)")
        tied = pipe.tied_weight if pipe is not None else None
        self.buckets = self._make_buckets(params[::-1], bucket_mb * 2 ** 20, tied)
        self._where = {id(p): (b, s) for b in self.buckets for p, s in zip(b.params, b.starts)}
        self._count = {id(p): 0 for p in params}
        self._next = 0  # the next bucket to launch
        self.launches = 0  # collectives launched during backward (tests count them)
        for b in self.buckets:
            b.waiting = len(b.params)
            if zero >= 1:
                self._flatten_params(b)
            if zero == 2:
                b.shard_grad = b.param_buf.new_zeros(b.shard[1] - b.shard[0])
            else:
                self._bind_grads(b)
        self._shards = self._make_shards() if zero >= 1 else []
        self._shard_of = {id(sh.param): sh for sh in self._shards}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: float, isolate) -> list[Bucket]:
        groups, current, size = [], [], 0
        for p in params:
            if p is isolate:
                groups += [current, [p]] if current else [[p]]
                current, size = [], 0
                continue
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        buckets = []
        for group in groups:
            starts = [sum(p.numel() for p in group[:i]) for i in range(len(group))]
            numel = -(-sum(p.numel() for p in group) // self.dp) * self.dp
            per = numel // self.dp
            buckets.append(Bucket(group, starts, numel, (self.dims.dp_rank * per, (self.dims.dp_rank + 1) * per)))
        return buckets

    def _flatten_params(self, b: Bucket) -> None:
        p0 = b.params[0]
        b.param_buf = torch.zeros(b.numel, dtype=p0.dtype, device=p0.device)
        for p, s in zip(b.params, b.starts):
            view = b.param_buf[s:s + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)

    def _bind_grads(self, b: Bucket) -> None:
        p0 = b.params[0]
        b.grad = torch.zeros(b.numel, dtype=p0.dtype, device=p0.device)
        for p, s in zip(b.params, b.starts):
            p.grad = b.grad[s:s + p.numel()].view_as(p)

    # ---- during backward ----------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        b, s = self._where[id(p)]
        if b.grad is None:  # ZeRO-2: the full-size buffer exists from the first gradient to the reduction
            b.grad = torch.zeros(b.numel, dtype=p.dtype, device=p.device)
        view = b.grad[s:s + p.numel()]
        if p.grad.data_ptr() != view.data_ptr():  # autograd made a fresh tensor: adopt it into the bucket
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)
        self._count[id(p)] += 1
        if self._count[id(p)] == self.microbatches:
            b.waiting -= 1
            if b.waiting == 0 and self.overlap:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._launch(self.buckets[self._next])
            self.launches += 1

    def _launch(self, b: Bucket) -> None:
        if b.grad is None:  # no parameter of the bucket got a gradient this step
            b.grad = torch.zeros(b.numel, dtype=b.params[0].dtype, device=b.params[0].device)
        if self.zero == 2:
            b.work = getattr(dist, _REDUCE_SCATTER)(b.shard_grad, b.grad, group=self.group, async_op=True)
        else:
            b.work = dist.all_reduce(b.grad, group=self.group, async_op=True)
        self._next += 1

    # ---- after backward -------------------------------------------------------------------------------
    def finish(self) -> None:
        while self._next < len(self.buckets):  # overlap off, or parameters that got no gradient
            self._launch(self.buckets[self._next])
        for b in self.buckets:
            b.work.wait()
            b.work = None
            (b.shard_grad if self.zero == 2 else b.grad).div_(self.dp)
            b.waiting = len(b.params)
        self._next = 0
        self._count = dict.fromkeys(self._count, 0)
        if self.zero < 2:
            super().finish()
            return
        for b in self.buckets:  # ZeRO-2: only the reduced shards remain
            for p in b.params:
                p.grad = None
            b.grad = None
        self._finish_shards()

    def _finish_shards(self) -> None:
        """`tensor.finish_grads` and the pipeline's tied-embedding sum, on gradient shards."""
        d = self.dims
        if d.tp > 1:
            sp_params = {id(p) for p in sequence_parallel_params(self.model)}
            marked = [sh.opt_key.grad for sh in self._shards if id(sh.param) in sp_params]
            if marked:
                flat = torch.cat(marked)
                dist.all_reduce(flat, group=d.tp_group)
                for g, part in zip(marked, flat.split([g.numel() for g in marked])):
                    g.copy_(part)
            for m in shared_row_layers(self.model):
                for p in (m.weight, m.bias):
                    if p is not None and id(p) in self._shard_of:
                        _sum_shared_rows(self._shard_of[id(p)], m.shared_rows, d.tp_group)
        pipe = self.pipe
        if pipe is not None and pipe.tied_group is not None and id(pipe.tied_weight) in self._shard_of:
            dist.all_reduce(self._shard_of[id(pipe.tied_weight)].opt_key.grad, group=pipe.tied_group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self.zero == 0:
            return super().clip_grad_norm_(max_norm)
        total = torch.zeros((), dtype=torch.float64, device=self.dims.device)  # as grads.local_square_sum
        for sh in self._shards:
            g = sh.opt_key.grad.to(torch.promote_types(sh.opt_key.dtype, torch.float32))
            if sh.norm_mask is not None:
                g = g[sh.norm_mask]
            total += g.pow(2).sum()
        for group, size in ((self.dims.dp_group, self.dp), (self.dims.tp_group, self.dims.tp),
                            (self.dims.pp_group, self.dims.pp)):
            if size > 1:
                dist.all_reduce(total, group=group)
        norm = total.sqrt()
        torch.nn.utils.clip_grads_with_norm_([sh.opt_key for sh in self._shards], max_norm, norm)
        return norm

    # ---- the distributed optimizer ----------------------------------------------------------------------
    def _make_shards(self) -> list[_Shard]:
        """Per parameter, its part of this rank's shard of its bucket (skipping empty intersections)."""
        masks = sharded_row_masks(self.model) if self.dims.tp > 1 else {}
        shards = []
        for b in self.buckets:
            lo, hi = b.shard
            for p, s in zip(b.params, b.starts):
                a, e = max(lo, s), min(hi, s + p.numel())
                if a >= e:
                    continue
                view = b.param_buf[a:e]
                view.grad = b.shard_grad[a - lo:e - lo] if self.zero == 2 else b.grad[a:e]
                mask = element_mask(p, counted_rows(p, masks, self.dims, self.pipe), a - s, e - s)
                shards.append(_Shard(p, a - s, e - s, view, mask))
        return shards

    def build_optimizer(self, groups: ParamGroups, make: MakeOptimizer) -> torch.optim.Optimizer:
        if self.zero == 0:
            return make(groups)
        sharded = [{**g, "params": [self._shard_of[id(p)].opt_key for p in g["params"] if id(p) in self._shard_of]}
                   for g in groups]
        return make(sharded)

    def after_step(self) -> None:
        if self.zero == 0:
            return
        works = []
        for b in self.buckets:  # every rank's updated shard into everyone's parameters
            lo, hi = b.shard
            works.append(getattr(dist, _ALL_GATHER)(b.param_buf, b.param_buf[lo:hi].clone(), group=self.group,
                                                    async_op=True))
        for w in works:
            w.wait()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.zero < 2:
            for b in self.buckets:
                b.grad.zero_()

    def save_ranges(self) -> list[Owned]:
        if self.zero == 0:
            return super().save_ranges()
        return [Owned(self.names[id(sh.param)], tuple(sh.param.shape), sh.lo, sh.hi, sh.opt_key.detach(),
                      sh.opt_key, _flat) for sh in self._shards]

    def load_state_ranges(self) -> list[Owned]:
        return super().load_state_ranges() if self.zero == 0 else self.save_ranges()



@dataclass
class _Shard:
    param: nn.Parameter
    lo: int  # flat range of `param` in this rank's shard
    hi: int
    opt_key: torch.Tensor  # 1-D view of the flat parameter buffer; .grad is the gradient shard
    norm_mask: torch.Tensor | None


def _sum_shared_rows(sh: _Shard, shared_rows, group) -> None:
    """Sum replicated KV rows' gradients over the tp ranks holding each head, on a flat shard.

    `shared_rows` = (local rows, their rows in a compact space common to all tp ranks, its size), as in
    `tensor.finish_grads`; the shard's element range is the same on every tp rank."""
    local, compact, n = shared_rows
    p, g = sh.param, sh.opt_key.grad
    cols = p.numel() // p.shape[0]
    row_map = torch.full((p.shape[0],), -1, dtype=torch.long, device=g.device)
    row_map[local.to(g.device)] = compact.to(g.device)
    idx = torch.arange(sh.lo, sh.hi, device=g.device)
    pos = row_map[idx // cols]
    sel = pos >= 0
    where = pos[sel] * cols + idx[sel] % cols
    space = g.new_zeros(n * cols)
    space[where] = g[sel]
    dist.all_reduce(space, group=group)
    g[sel] = space[where]


# ---- ZeRO-3: FSDP2 ------------------------------------------------------------------------------------------
class FullyShardedDataParallel(GradSync):
    """ZeRO-3 through FSDP2: each layer, then the model (or each pipeline stage) `fully_shard`ed over dp."""

    zero = 3

    def __init__(self, model: nn.Module, dims: ParallelDims, pipe=None):
        from torch.distributed.fsdp import fully_shard

        from meshlm.models.registry import spec_of

        super().__init__(model, dims, pipe)
        mesh = dims.mesh["dp"]
        self.roots = list(pipe.modules) if pipe is not None else [model]
        layers_attr = spec_of(model).pipeline.layers
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


def apply_data_parallel(model: nn.Module, dims: ParallelDims, cfg: Config, microbatches: int, pipe=None,
                        overlap: bool = True) -> GradSync:
    """The gradient synchronisation for this layout; call after every other transform (it hooks, flattens
    or shards the final parameters), then build the optimizer with `sync.build_optimizer`.

    `microbatches`: backward passes per step on this rank (the accumulation count, or the pipeline's m).
    """
    check_data_parallel(cfg, dims.tp)
    if dims.dp == 1:
        return GradSync(model, dims, pipe)
    if cfg.parallel.zero == 3:
        return FullyShardedDataParallel(model, dims, pipe)
    return BucketedDataParallel(model, dims, microbatches, cfg.parallel.zero, pipe, cfg.parallel.bucket_mb, overlap)
