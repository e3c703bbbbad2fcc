"""Parallelism applied from outside a plain model: `build_model(cfg, dims, spec=)` and
`parallelize(model, dims, cfg, spec=)`.

Each parallelism is one `apply_*` transform in its own module, driven by the model family's `ModelSpec`,
which the caller hands in (this package never looks one up); `parallelize` runs them in a fixed order
(with the caller's `transforms`, e.g. adapters, after materialisation) and returns one `Parallelized`
object holding everything a training step needs. `build_model` builds the family's model on the meta
device first, so each rank only ever allocates and initialises its own shards (`materialize.py`).

May import: core, data, models, families (never `families.registry`: the spec is an argument).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from meshlm.core.config import Config
from meshlm.core.layout import Layout, plan_layout
from meshlm.families.spec import ModelSpec
from meshlm.models.init import meta_device
from meshlm.parallel.context import ContextParallelLoss, apply_context_parallel
from meshlm.parallel.data import GradSync
from meshlm.parallel.dp import apply_data_parallel
from meshlm.parallel.expert import apply_expert_parallel
from meshlm.parallel.materialize import materialize
from meshlm.parallel.mesh import ParallelDims, destroy, init_distributed
from meshlm.parallel.pipeline import Pipeline, build_pipeline, cut_stages, fused_head
from meshlm.parallel.recompute import apply_recompute
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor import LossFn, apply_tensor_parallel, clip_grad_norm_, finish_grads, full_state_dict

__all__ = ["GradSync", "ParallelDims", "Parallelized", "TPRNGTracker", "Transform", "build_model", "clip_grad_norm_",
           "destroy", "finish_grads", "full_state_dict", "init_distributed", "parallelize"]

# A transform of this rank's materialised part of the model, in place: (model, spec, cfg, dims, rng) → None.
# `parallelize` applies the ones it is given after materialisation, before the pipeline schedule, so every
# later step (schedule, recomputation, data parallelism) sees what they add (`meshlm tune`'s adapters).
Transform = Callable[[nn.Module, ModelSpec, Config, ParallelDims, TPRNGTracker | None], None]


@dataclass
class Parallelized:
    """This rank's part of a parallel model, and what a step needs around it.

    `model` is the plain model pruned and transformed in place (plain parameter names: checkpoints and
    the optimizer's groups read them); `loss_fn(output, targets)` the loss on its output (vocab-parallel
    under tp); `pipeline` this rank's stages and schedule (None without pp); `grad_sync` the gradient
    synchronisation: reductions over dp, the tp/pp fix-ups, the norm and clipping, ZeRO's shards
    (build the optimizer with `train.optim.build_optimizer(grad_sync, cfg.optim)`).
    """

    model: nn.Module
    spec: ModelSpec
    dims: ParallelDims
    loss_fn: LossFn
    pipeline: Pipeline | None
    grad_sync: GradSync
    rng: TPRNGTracker | None
    layout: Layout  # the layout's numbers: micro-batches per rank and step, layers per virtual stage


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config, rng: TPRNGTracker | None = None, *,
                spec: ModelSpec, transforms: Sequence[Transform] = ()) -> Parallelized:
    """Transform a plain model (initialised, or built on the meta device) into this rank's part of the layout.

    Order matters:
    1. tensor parallel first: it swaps linears/embeddings for their sharded versions, which every later
       transform (activation recomputation, compile, data-parallel wrapping) must see, not the dense ones.
       Then context parallelism (`parallel.cp` > 1): the model takes whole rows and runs this rank's two
       chunks, its attention cores become the ring (`context.py`), the loss the row's mean; before the
       pipeline's stages, which call the model's (now context-parallel) methods. Then expert parallelism
       (`parallel.ep` > 1, `expert.py`): each MoE layer keeps its rank's slice of the experts (before
       materialisation: only that slice is allocated) and dispatches tokens by all-to-all.
    2. pipeline cutting (`parallel.pp` > 1): it groups the (parallel) modules into this rank's stages and
       prunes the rest. Before recomputation, whose chunks and `block` counts are per stage, as in Megatron.
    3. materialisation of a meta-built model: only now is it known what this rank holds, so only that is
       allocated and initialised (to its slices of the single-process initialisation).
       Then `transforms`, each called as `transform(model, spec, cfg, dims, rng)`: the caller's changes to
       this rank's part (`meshlm tune`'s adapters: LoRA on the parallel linears, virtual tokens on the first
       stage's embedding, the base frozen), which every later transform sees.
    4. the pipeline schedule and the tied-embedding group, over the real parameters.
    5. activation recomputation (`train.recompute`): it wraps the parallel layers' forwards (full) or
       attention core (selective), so a recomputed region replays the sharded computation, its collectives
       and the TP dropout stream; before compile, which must trace the checkpoint regions, and before
       data-parallel wrapping, which must see the final modules.
    6. data parallelism last (`parallel.dp`, `parallel.zero`; reduced over dp × cp): its gradient hooks, flat buffers or FSDP2
       shards must hold the final parameters of this rank's stages.
    """
    # Every layout rule at once, for this world (core/layout.py), before anything is transformed.
    layout = plan_layout(cfg, dims.pp, dims.dp, dims.tp, spec.stage_costs(cfg.model), cp=dims.cp, decoder=spec.decoder)
    if rng is None and dims.tp > 1:  # one TP dropout stream, shared by TP and the recomputation that replays it
        rng = TPRNGTracker(torch.initial_seed(), dims.tp_rank, dims.device)
    loss_fn = apply_tensor_parallel(model, dims, sp=cfg.parallel.sp, rng=rng, spec=spec)
    if dims.cp > 1:  # whole rows in, this rank's chunks run; the attention cores become the ring
        apply_context_parallel(model, dims, spec=spec, sequence_parallel=cfg.parallel.sp)
        loss_fn = ContextParallelLoss(loss_fn, dims)
    if dims.ep > 1 or dims.cp > 1 or (dims.tp > 1 and cfg.parallel.sp):  # MoE: experts, all-to-all, token groups
        apply_expert_parallel(model, dims, cfg)
    cut = cut_stages(model, spec, cfg, dims.pp_rank, fused_head(cfg, dims, spec)) if dims.pp > 1 else None
    if any(p.is_meta for p in model.parameters()):
        materialize(model, spec, dims.device)
    for transform in transforms:  # e.g. adapters on the (parallel) linears or the embedding; the base frozen
        transform(model, spec, cfg, dims, rng)
    pipe = build_pipeline(model, spec, dims, cfg, loss_fn, cut) if cut is not None else None
    for stage in pipe.modules if pipe is not None else [model]:
        apply_recompute(stage, cfg, rng, spec=spec)
    sync = apply_data_parallel(model, dims, cfg, layout.microbatches, pipe, spec=spec)
    return Parallelized(model, spec, dims, loss_fn, pipe, sync, rng, layout)


def build_model(cfg: Config, dims: ParallelDims, rng: TPRNGTracker | None = None, *, spec: ModelSpec,
                transforms: Sequence[Transform] = ()) -> Parallelized:
    """`cfg.model.family`'s model for this rank: built on the meta device (one draw from the global
    generator, as a whole build makes), parallelised, and only this rank's shards allocated on `dims.device`
    and initialised, equal to the slices of `spec.model_class(cfg.model)` built whole from the same seed;
    then `transforms` (see `parallelize`)."""
    with meta_device():
        model = spec.model_class(cfg.model)
    return parallelize(model, dims, cfg, rng, spec=spec, transforms=transforms)
