"""Data parallelism with our bucketed reducer (ZeRO stages 0, 1 and 2); the design is in `parallel/data.py`'s
docstring: per-parameter post-accumulate-grad hooks count each step's backward passes, full buckets are
reduced over dp while backward goes on, and under ZeRO-1/2 each rank steps and keeps only its shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshlm.parallel.data import GradSync, MakeOptimizer, Owned, ParamGroups, _flat
from meshlm.parallel.grads import (
    counted_rows,
    element_mask,
    sequence_parallel_params,
    sharded_row_masks,
    shared_row_layers,
)
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.tensor_layers import ALL_GATHER, REDUCE_SCATTER


@dataclass
class Bucket:
    params: list[nn.Parameter]
    starts: list[int]  # offset of each parameter in the flat buffers
    numel: int  # padded to a multiple of dp
    shard: tuple[int, int]  # this dp rank's [lo, hi) of the flat buffers
    grad: torch.Tensor | None = None  # full-size gradients (ZeRO-2: from the step's first gradient to the reduction)
    shard_grad: torch.Tensor | None = None  # ZeRO-2: the reduced shard (from the reduction to `zero_grad`)
    param_buf: torch.Tensor | None = None  # ZeRO-1/2: the parameters, flat (each p.data is a view)
    waiting: int = 0  # parameters that have not yet seen the step's last micro-batch
    work: object = None  # the pending collective


class BucketedDataParallel(GradSync):
    """ZeRO 0, 1 or 2 over dp > 1 with our bucketed, backward-overlapped reduction (module docstring)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, microbatches: int, zero: int = 0, pipe=None,
                 bucket_mb: float = 25.0, overlap: bool = True):
        super().__init__(model, dims, pipe)
        self.zero, self.microbatches, self.overlap = zero, microbatches, overlap
        self.group, self.dp = dims.dpcp_group, dims.dpcp  # the weights' replicas: dp (× cp)
        # expert slices (ep > 1) are reduced over their own group by `expert.ExpertDataParallel`
        params = [p for p in model.parameters() if p.requires_grad and getattr(p, "expert_rows", None) is None]
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
            if zero < 2:
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
            buckets.append(Bucket(group, starts, numel, (self.dims.dpcp_rank * per, (self.dims.dpcp_rank + 1) * per)))
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
            b.shard_grad = b.grad.new_empty(b.shard[1] - b.shard[0])
            b.work = getattr(dist, REDUCE_SCATTER)(b.shard_grad, b.grad, group=self.group, async_op=True)
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
        for sh in self._shards:
            b, lo = sh.bucket, sh.bucket.shard[0]
            sh.opt_key.grad = b.shard_grad[sh.flat_lo - lo:sh.flat_hi - lo]
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
        for group, size in ((self.group, self.dp), (self.dims.tp_group, self.dims.tp),
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
                if self.zero == 1:  # ZeRO-2 binds the reduced shard's view at each step's `finish`
                    view.grad = b.grad[a:e]
                mask = element_mask(p, counted_rows(p, masks, self.dims, self.pipe), a - s, e - s)
                shards.append(_Shard(p, a - s, e - s, view, mask, b, a, e))
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
            works.append(getattr(dist, ALL_GATHER)(b.param_buf, b.param_buf[lo:hi].clone(), group=self.group,
                                                    async_op=True))
        for w in works:
            w.wait()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.zero < 2:
            for b in self.buckets:
                b.grad.zero_()
            return
        # ZeRO-2: the shards have been stepped; they are freed, so that the next step's micro-batches run
        # beside the full-size gradient buffers alone (8 + 8/dp B/param at fp32, as ZeRO-1), not those and
        # the shards
        for sh in self._shards:
            sh.opt_key.grad = None
        for b in self.buckets:
            b.shard_grad = None

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
    bucket: Bucket
    flat_lo: int  # the same range in the bucket's flat buffers
    flat_hi: int


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
