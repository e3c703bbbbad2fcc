"""Tensor parallelism applied from outside a plain model, by its family's plan (Megatron; Korthikanti).

The math and the layers are in `tensor_layers.py`; which submodule becomes which is the model family's
`tp_plan` (`families/registry.py`, styles in `styles.py`). `apply_tensor_parallel` walks that plan and swaps
the modules of a plain model in place, keeping their names (`layers.3.attn.qkv` stays the path of the
parallel layer), so the pipeline, recomputation, data parallelism and checkpoints see plain names.

It works on a model built on the meta device as on an initialised one: on a real model each parallel layer
takes its slice of the dense weights (so tp=N starts bit-identical to tp=1); on the meta device only the
shards' shapes are made, and `parallel.materialize.materialize` then fills each rank's shards with exactly
those slices (`models/init.py`) without the whole model ever existing in one process.

After backward, `finish_grads` completes the gradients tp ranks hold only parts of, and `grad_norm`
counts every element of the whole model once: the two rules every gradient synchroniser uses.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch import nn

from meshlm.families.spec import ModelSpec, family_loss
from meshlm.models.loss import TokenOps
from meshlm.parallel.grads import (
    local_square_sum,
    sequence_parallel_params,
    shared_row_layers,
    sum_over_group,
    sum_shared_rows,
)
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.styles import TPContext, apply_style
from meshlm.parallel.tensor_layers import (
    ColumnParallelLinear,
    LossFn,
    RowParallelLinear,
    VocabParallelEmbedding,
    _all_reduce,
    vocab_parallel_correct,
    vocab_parallel_cross_entropy,
)


# ---- transforming a plain model ---------------------------------------------------------------------------
def plan_targets(model: nn.Module, pattern: str) -> list[str]:
    """Paths of `model`'s submodules that match an fnmatch `pattern` (a slot holding None matches nothing)."""
    return [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, sp: bool = False,
                          rng: TPRNGTracker | None = None, *, spec: ModelSpec) -> LossFn:
    """Turn a plain model (initialised, or on the meta device) into this rank's tensor-parallel shard, in
    place, following its family's `tp_plan`.

    Returns the loss to use on its output: the family's loss at tp = 1, else the vocab-parallel
    cross-entropy over (B, T, V/t) logits. With `sp`, the residual stream between layers is split along
    the sequence (seq_len divisible by tp). `rng` provides the per-rank dropout stream (default: seeded
    from `torch.initial_seed()`). `dims` may be a planned layout without process groups (group None):
    then the shards are made but cannot communicate (`benchmarks/init_memory.py`).
    Call `finish_grads(model, dims)` after backward and before clipping; use `grad_norm` for the norm.
    """
    cfg = model.cfg
    if dims.tp == 1:
        return family_loss(spec, cfg)
    spec.check_tensor_parallel(cfg, dims.tp, sp)
    rng = rng or TPRNGTracker(torch.initial_seed(), dims.tp_rank, dims.device)
    ctx = apply_plan(model, spec.tp_plan(cfg), TPContext(dims.tp_group, dims.tp, dims.tp_rank, sp, rng))
    if not ctx.vocab_parallel_output:
        return family_loss(spec, cfg)
    ops = TokenOps(functools.partial(vocab_parallel_cross_entropy, group=dims.tp_group, vocab_size=cfg.vocab_size),
                   functools.partial(vocab_parallel_correct, group=dims.tp_group, vocab_size=cfg.vocab_size))
    if getattr(model, "logits_loss", False) is None:  # a model that computes its own loss from the stream (GPT's
        model.logits_loss = ops.ce  # multi-token prediction, `head_loss`) gets the vocab-parallel cross-entropy
    return family_loss(spec, cfg, ops)


def apply_plan(model: nn.Module, plan: dict, ctx: TPContext) -> TPContext:
    """Apply each style of `plan` (pattern → style, in order) to the matching submodules of `model`."""
    for pattern, style in plan.items():
        for path in plan_targets(model, pattern):
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            apply_style(style, model, parent, attr, path, ctx)
    return ctx


# ---- gradients, norms and the full weights ---------------------------------------------------------------
def finish_grads(model: nn.Module, dims: ParallelDims) -> None:
    """Complete the gradients tp ranks hold only parts of (`parallel/grads.py`, rules 1 and 2); call after
    backward, before clipping.

    * parameters marked `sequence_parallel` saw only this rank's tokens: their gradients are summed over
      tp (one coalesced all-reduce);
    * KV rows replicated over t/n_kv_heads ranks are summed over the ranks holding each head (one
      all-reduce of the compact KV space per layer, zeros where a rank holds nothing).
    Explicit rather than autograd hooks: it runs once per optimizer step, not once per micro-batch.
    """
    if dims.tp == 1:
        return
    sum_over_group([p.grad for p in sequence_parallel_params(model) if p.grad is not None], dims.tp_group)
    for m in shared_row_layers(model):
        for p in (m.weight, m.bias):
            if p is not None and p.grad is not None:
                sum_shared_rows(p.grad, m.shared_rows, dims.tp_group)


def grad_norm(model: nn.Module, dims: ParallelDims) -> torch.Tensor:
    """‖∇‖₂ of the whole (unsharded) model, each element counted by one rank (`parallel/grads.py`, rules
    a and b); one all-reduce over tp sums the squares."""
    total = local_square_sum(model.parameters(), dims, model=model)
    if dims.tp > 1:
        total = _all_reduce(total, dims.tp_group)
    return total.sqrt()


def clip_grad_norm_(model: nn.Module, dims: ParallelDims, max_norm: float) -> torch.Tensor:
    """Tensor-parallel `torch.nn.utils.clip_grad_norm_`: the norm from `grad_norm`, the scaling local."""
    norm = grad_norm(model, dims)
    params = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain `GPT` state dict, gathered on every rank (a collective: every tp rank must call it)."""
    owners = {}
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            for pname, _ in m.named_parameters(recurse=False):
                owners[f"{name}.{pname}" if name else pname] = (m, pname)
    out, done = {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in owners:
            m, pname = owners[key]
            if id(value) not in done:  # tied weights: gather once
                done[id(value)] = m.full_weight(pname)
            out[key] = done[id(value)]
        else:
            out[key] = value.detach().clone()
    return out
