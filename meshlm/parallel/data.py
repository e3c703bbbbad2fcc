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
* 3: PyTorch's FSDP2 `fully_shard(..., mesh=dpcp_mesh)` (over dp × cp) on each layer and on the model or each pipeline
  stage: parameters, gradients and states sharded, gathered per layer for compute. Under tp it shards the
  tp-local tensors by rows, and the tp fix-ups run on the reduced row shards (`fsdp.py`).
Gradient norms under ZeRO sum the squares of each rank's shard (each element counted once across the
whole layout) and all-reduce them over dp (× cp), tp and pp. Under context parallelism every "dp" above is
the dp × cp group: the cp ranks hold the same weights and each reduces its own tokens' gradients.

Memory per parameter for model states (docs/formulas.md). meshlm keeps fp32 parameters, which serve as the
master weights, and autocasts per op for bf16: there is no separate 16-bit weight copy, so both fp32 and
bf16 runs hold 4 (weights) + 4 (gradients) + 8 (Adam m, v) = 16 B/param, 8 + 8/d with ZeRO-1,
4 + 12/d with ZeRO-2 (between steps; the local gradients are whole during backward) and 16/d with
ZeRO-3 (plus one layer's gathered weights while it runs). `optim.name=muon` keeps one buffer (4 B) on the
hidden matrices instead of Adam's two: 8 + 4·S at ZeRO-0, S the optimizer's states per parameter (between
1 and 2). Megatron's 18 and 6 + 12/d count a 16-bit weight copy beside fp32 masters, which meshlm does not
have. `state_bytes` measures what is allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.tensor import clip_grad_norm_ as tp_clip_grad_norm_
from meshlm.parallel.tensor import finish_grads

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
        """‖∇‖₂ of the whole model, and the gradients scaled to at most `max_norm`.

        Every layout sums the squares the same way (`grads.local_square_sum`), one process included:
        `torch.nn.utils.clip_grad_norm_`'s fp32 `vector_norm` on the CPU was 9.5e-6 below the exact norm of
        gpt-tiny's 3.2M-element embedding gradient (torch 2.13), so one process disagreed with tp and pp."""
        if self.pipe is not None:
            return self.pipe.clip_grad_norm_(self.model, max_norm)
        return tp_clip_grad_norm_(self.model, self.dims, max_norm)  # tp = 1: the local sum of squares

    def build_optimizer(self, groups: ParamGroups, make: MakeOptimizer) -> torch.optim.Optimizer:
        """`make(groups)`, with `groups` (over the model's parameters, e.g. weight-decay groups) mapped to
        what this rank steps: the parameters themselves, or under ZeRO its shards of them."""
        return make(groups)

    def after_step(self) -> None:
        """After the optimizer step (ZeRO-1/2: all-gather the updated parameter shards)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def average_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's mean micro-batch loss → the global batch's (the mean over dp, and cp: each cp rank's
        share is re-weighted to sum to its rows' mean, `parallel/context.py`)."""
        if self.dims.dpcp == 1:
            return loss
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.dims.dpcp_group)
        return total / self.dims.dpcp

    # ---- what this rank holds, for checkpoints -------------------------------------------------------
    def _whole(self, p: torch.Tensor) -> Owned:
        return Owned(self.names[id(p)], tuple(p.shape), 0, p.numel(), p.detach().view(-1), p, _flat)

    def _base_parameters(self) -> list[nn.Parameter]:
        """The model's own parameters: adapters (`tune/`) are saved by `tune/state.py` instead."""
        return [p for p in self.model.parameters() if not getattr(p, "adapter", False)]

    def save_ranges(self) -> list[Owned]:
        """The ranges whose weights and optimizer states this rank writes (each dp replica once)."""
        return [self._whole(p) for p in self._base_parameters()] if self.dims.dpcp_rank == 0 else []

    def load_weight_ranges(self) -> list[Owned]:
        """The ranges of parameters this rank must read back."""
        return [self._whole(p) for p in self._base_parameters()]

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


def theory_bytes_per_param(zero: int, dp: int, states: float = 2.0) -> float:
    """Model-state bytes per parameter with fp32 weights (= master weights) over dp ranks, for an optimizer
    that keeps `states` fp32 tensors per parameter (Adam's m and v: 2; `optim.name=muon`: 1 on the hidden
    matrices, 2 elsewhere, `state_tensors_per_param`)."""
    opt = 4.0 * states
    return {0: 8 + opt, 1: 8 + opt / dp, 2: 4 + (4 + opt) / dp, 3: (8 + opt) / dp}[zero]


def theory_formula(zero: int, dp: int, states: float = 2.0) -> str:
    """`theory_bytes_per_param` as written in the log: Adam's `16`, `8 + 8/d`, …; with fewer states
    (Muon), weights 4 + gradients 4 + 4 × the states per parameter."""
    if states == 2.0:
        return {0: "16", 1: f"8 + 8/{dp}", 2: f"4 + 12/{dp}", 3: f"16/{dp}"}[zero]
    opt = f"4 × {states:.3f}"
    return {0: f"8 + {opt}", 1: f"8 + {opt}/{dp}", 2: f"4 + (4 + {opt})/{dp}", 3: f"(8 + {opt})/{dp}"}[zero]


def state_tensors_per_param(optimizer: torch.optim.Optimizer) -> float:
    """The fp32 state tensors `optimizer` keeps per parameter, weighted by size: 1 (Muon's momentum buffer)
    on the groups marked `"muon"`, 2 (Adam's or LAMB's two moments) on the others; 2.0 for no parameters.
    What the model-state memory formulas take (`parallel.data.theory_bytes_per_param`)."""
    sizes = [(sum(p.numel() for p in g["params"]), 1 if g.get("muon") else 2) for g in optimizer.param_groups]
    total = sum(n for n, _ in sizes)
    return sum(n * k for n, k in sizes) / total if total else 2.0



def memory_report(sync: GradSync, optimizer: torch.optim.Optimizer) -> str:
    """One line for rank 0's log (a collective over the world: the largest rank's total is included). The
    theory counts the states the optimizer built keeps (`state_tensors_per_param`)."""
    b = sync.state_bytes(optimizer)
    total = b["params"] + b["grads"] + b["optim"]
    worst = torch.tensor([float(total)])
    if dist.is_initialized() and sync.dims.world_size > 1:
        worst = worst.to(sync.dims.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    mib = 2.0 ** 20
    zero, dp = sync.zero, sync.dims.dpcp  # the optimizer is sharded over the weights' replicas: dp × cp
    over = f"dp={dp}" if sync.dims.cp == 1 else f"dp × cp={dp}"
    states = state_tensors_per_param(optimizer)
    which = "" if states == 2.0 else f", {states:.3f} optimizer states per parameter (Muon's 1 on the hidden " \
        "matrices, Adam's 2 elsewhere)"
    return (f"model states, rank 0: params {b['params'] / mib:.2f} + grads {b['grads'] / mib:.2f} + optimizer "
            f"{b['optim'] / mib:.2f} = {total / mib:.2f} MiB for {b['n_params']:,} parameters = "
            f"{total / max(1, b['n_params']):.2f} B/param (theory, ZeRO-{zero} over {over}, fp32 weights as "
            f"master weights{which}: {theory_formula(zero, dp, states)} = "
            f"{theory_bytes_per_param(zero, dp, states):.2f} B/param); largest rank {float(worst) / mib:.2f} MiB")
