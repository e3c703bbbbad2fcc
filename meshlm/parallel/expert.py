"""Expert parallelism (`parallel.ep`): each MoE layer's experts split over ep ranks; tokens travel to their
experts and back by all-to-all (GShard; Megatron's and torchtitan's expert-parallel groups).

Groups (`mesh.py`). The ep ranks are carved from the dp × cp ranks of one (pp, tp) coordinate, which hold
the same non-expert weights: dp × cp index i (`dpcp_rank`) sits in ep group i // ep (ep consecutive
indices) as its rank i % ep (`ep_rank`), and holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep) of every MoE
layer; the dp·cp/ep ranks with the same ep_rank (the expert-data-parallel group, `edp_group`) hold the same
experts. Every rank still runs its own micro-batches (ep does not change what a rank reads).

Forward (`AllToAllDispatch`, the MoE layer's `dispatch`, models/moe.py): the layer routes its own tokens
(capacity included, on its own token set), then the assignments are sorted by expert, which is sorted by
destination rank; one all-to-all of the per-expert counts, then `all_to_all_single` of the token rows;
each rank runs its experts on the rows it received (sorted by local expert: `Experts.run`), and a second
all-to-all sends the outputs back, where they are weighted and summed per token in the order one process
sums them. Backward runs the two all-to-alls in reverse (torch.distributed.nn's autograd all-to-all), so
each expert's gradient holds the contributions of every token of its ep group.

Gradients (`ExpertDataParallel`): the non-expert weights are reduced over dp × cp as without ep (the
bucketed reducer, ZeRO 0-2, leaves the expert parameters alone); the expert parameters are summed over
their edp group and divided by dp × cp (each already sums its ep group's tokens), so both are the
global batch's mean, as in one process. The expert parameters' optimizer states are whole on every rank of
their edp group (ZeRO-1/2 shard the non-expert states only); ZeRO-3 with ep is refused (core/layout.py).
The gradient norm counts each element once: non-expert as the reducer does, each expert by edp rank 0 (and
tp rank 0), one all-reduce over the world.

Tensor parallelism: the MoE layer is not split over tp (the family's tp plan names no MoE module): every tp
rank holds the router, its ep slice of the experts and the shared experts whole, and runs them on the
tokens it has, the whole sequence without SP (the tp ranks compute the same thing), its sequence shard
with SP (then the MoE parameters saw only this rank's tokens and their gradients are summed over tp, as
the norms' are; the load-balancing loss counts the expert load over the tp group, and each rank's aux and z
losses weigh 1/tp, so they are one process's). Context parallelism counts the load over the cp group
alike (its gradients are averaged, so no weight). The ep groups
are per tp rank. Pipeline stages and recomputation need nothing more: every rank of an ep group is at the
same stage and runs the same micro-batches in the same order, so the all-to-alls pair up (a recomputed
forward replays them).

Checkpoints store each expert tensor as the whole (E, …) logical tensor: a rank's slice is rows
[first, first + E/ep) of it (`expert_rows`, read by checkpoint/sharded.py), written by edp rank 0 and tp
rank 0, so a checkpoint saved under one ep loads under any other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshlm.core.config import Config
from meshlm.models.moe import Experts, add_rows, moe_layers
from meshlm.parallel.data import GradSync, MakeOptimizer, Owned, ParamGroups
from meshlm.parallel.grads import local_square_sum, sum_over_group
from meshlm.parallel.mesh import ParallelDims

EXPERT_PARAMS = ("fc", "proj", "fc_bias", "proj_bias")  # `Experts`' stacked parameters, (E, …) each (biases: moe_bias)


def is_expert(p: torch.Tensor) -> bool:
    """A parameter holding this rank's slice of the experts (`apply_expert_parallel` marks them)."""
    return getattr(p, "expert_rows", None) is not None


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of rows, differentiable: backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class AllToAllDispatch:
    """The MoE layer's dispatch over an ep group (module docstring); equal to `LocalDispatch` in one process."""

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 module: Experts) -> torch.Tensor:
        n_local = module.n_local
        order = torch.argsort(experts, stable=True)  # by expert, hence by destination rank
        send = torch.bincount(experts, minlength=module.n_experts).view(self.ep, n_local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # counts first: [source rank, local expert]
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = x.index_select(0, tokens[order])
        got = _AllToAll.apply(rows, recv_splits, send_splits, self.group)
        local = torch.arange(n_local, device=x.device).repeat(self.ep).repeat_interleave(recv.reshape(-1))
        perm = torch.argsort(local, stable=True)  # by local expert, each expert's rows in source-rank order
        out = module.run(got.index_select(0, perm), recv.sum(0))
        if not out.requires_grad and got.requires_grad:  # no rows here: keep the backward all-to-all paired
            out = out + got.sum() * 0
        back = out.index_select(0, torch.argsort(perm))  # source-rank order again
        ret = _AllToAll.apply(back, send_splits, recv_splits, self.group)
        return add_rows(x, tokens[order], (ret * weights[order, None]).to(x.dtype))  # (saves the index only)


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, cfg: Config) -> None:
    """This rank's experts of every MoE layer (meta or real parameters: the slice of the whole stack), the
    all-to-all dispatch (ep > 1), under tp + SP the MoE parameters marked to be summed over tp, and under cp
    or SP the groups holding the rest of each row's tokens, over which the router's load is counted
    (`MoE.token_groups`; each SP rank's aux and z losses weighted 1/tp, as its gradients are summed)."""
    ep, sp = dims.ep, cfg.parallel.sp and dims.tp > 1
    token_groups = tuple(([dims.cp_group] if dims.cp > 1 else []) + ([dims.tp_group] if sp else []))
    for _, moe in moe_layers(model):
        moe.token_groups, moe.aux_weight = token_groups, 1.0 / dims.tp if sp else 1.0
        experts = moe.experts
        if sp:  # ep > 1: the expert slices' tp sums are `ExpertDataParallel`'s
            for p in moe.parameters():
                if ep == 1 or not any(p is getattr(experts, n) for n in EXPERT_PARAMS):
                    p.sequence_parallel = True
        if ep == 1:
            continue
        n_local = experts.n_experts // ep
        first = dims.ep_rank * n_local
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            if p is None:  # no expert biases (model.moe_bias=false)
                continue
            part = torch.empty((n_local, *p.shape[1:]), dtype=p.dtype, device="meta") if p.is_meta \
                else p.detach()[first:first + n_local].clone()
            new = nn.Parameter(part, requires_grad=p.requires_grad)
            new.expert_rows = (first, first + n_local)
            setattr(experts, name, new)
        experts.n_local, experts.first = n_local, first
        if ep > 1:
            moe.dispatch = AllToAllDispatch(dims.ep_group, ep)


class ExpertDataParallel(GradSync):
    """The data-parallel synchroniser `inner` (ZeRO 0-2 over dp × cp, which skips the expert parameters) plus
    the expert parameters' own reduction over their edp group, one norm and one optimizer (module docstring)."""

    def __init__(self, inner: GradSync, sp: bool):
        super().__init__(inner.model, inner.dims, inner.pipe)
        self.inner, self.zero, self.sp = inner, inner.zero, sp
        self.experts = [p for p in self.model.parameters() if is_expert(p)]
        self._ids = {id(p) for p in self.experts}

    def set_last_microbatch(self, last: bool) -> None:
        self.inner.set_last_microbatch(last)

    def average_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.average_loss(loss)

    def finish(self) -> None:
        self.inner.finish()
        d = self.dims
        for p in self.experts:
            if p.grad is None:  # no token reached these experts on any micro-batch: still reduced alike
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.experts]
        if self.sp and d.tp > 1:  # each tp rank ran its sequence shard through the experts
            sum_over_group(grads, d.tp_group)
        if d.edp > 1:
            sum_over_group(grads, d.edp_group)
        for g in grads:
            g.div_(d.dpcp)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        d, inner = self.dims, self.inner
        total = torch.zeros((), dtype=torch.float64, device=d.device)
        if self.zero == 0:  # whole gradients, equal on every dp × cp replica: counted on replica 0
            dense = [p for p in self.model.parameters() if id(p) not in self._ids]
            if d.dpcp_rank == 0:
                total += local_square_sum(dense, d, self.pipe, self.model)
        else:  # this rank's shards, each element of the flat buffers once over dp × cp
            dense = [sh.opt_key for sh in inner._shards]
            for sh in inner._shards:
                g = sh.opt_key.grad.to(torch.promote_types(sh.opt_key.dtype, torch.float32))
                total += (g if sh.norm_mask is None else g[sh.norm_mask]).pow(2).sum()
        if d.edp_rank == 0 and d.tp_rank == 0:  # each expert once: tp replicas and edp replicas skipped
            for p in self.experts:
                total += p.grad.to(torch.promote_types(p.dtype, torch.float32)).pow(2).sum()
        dist.all_reduce(total)  # over the world: dp × cp, tp and pp
        norm = total.sqrt()
        torch.nn.utils.clip_grads_with_norm_([p for p in dense + self.experts if p.grad is not None], max_norm, norm)
        return norm

    def build_optimizer(self, groups: ParamGroups, make: MakeOptimizer) -> torch.optim.Optimizer:
        if self.zero == 0:
            return make(groups)
        shard_of = self.inner._shard_of
        return make([{**g, "params": [shard_of[id(p)].opt_key for p in g["params"] if id(p) in shard_of]
                      + [p for p in g["params"] if id(p) in self._ids]} for g in groups])

    def after_step(self) -> None:
        self.inner.after_step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.zero_grad(optimizer)
        for p in self.experts:
            p.grad = None

    def _dense(self, ranges: list[Owned]) -> list[Owned]:
        return [o for o in ranges if id(o.opt_key) not in self._ids]

    def save_ranges(self) -> list[Owned]:
        mine = [self._whole(p) for p in self.experts] if self.dims.edp_rank == 0 else []
        return self._dense(self.inner.save_ranges()) + mine

    def load_weight_ranges(self) -> list[Owned]:
        return self._dense(self.inner.load_weight_ranges()) + [self._whole(p) for p in self.experts]

    def load_state_ranges(self) -> list[Owned]:
        return self._dense(self.inner.load_state_ranges()) + [self._whole(p) for p in self.experts]

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.inner.state_bytes(optimizer)
