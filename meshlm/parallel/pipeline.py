"""Pipeline parallelism (Narayanan et al. 2021): the layers cut into `pp × vpp` stages, micro-batches run
through them by `torch.distributed.pipelining`'s 1F1B or interleaved-1F1B schedule.

Layout. The model is cut into S = pp·vpp *virtual stages* of consecutive layers; stage s lives on pipeline
rank s mod pp (with vpp = 1 that is just stage r on rank r). Stage 0 also holds the modules the family's
`PipelinePlan.first` names (embeddings), stage S−1 those of `last` (final norm, output layer).
`core.layout.partition_layers` balances the layer counts with that extra work counted (the family's
`stage_costs`), or takes `parallel.pp_layers` as given. A stage runs the model's own `embed`,
`run_layers` and `head` (`families/spec.py`) on its part: there is no second copy of the model's forward.

Schedules. With m micro-batches per step (m = global_batch / (micro_batch · dp)), 1F1B runs on stage r
min(m, pp − r) forwards (warm-up), then alternates one backward and one forward (steady state), then the
remaining backwards (cool-down); at most pp micro-batches' activations are alive on the first stage. Its
idle time ("bubble") is (pp − 1)/m of the ideal step time; the interleaved schedule, with vpp chunks per
rank, cuts it to (pp − 1)/(vpp·m) for vpp times the point-to-point messages. We use torch's
`Schedule1F1B` / `ScheduleInterleaved1F1B` (and `ScheduleGPipe` when m < pp, which 1F1B does not
accept): they are exact under gloo and NCCL, so nothing here reimplements a schedule.

Equal to the single-process run. The loss the schedule back-propagates is `loss(logits, y) / m` with
`scale_grads=False`: the very same expression, and hence the same gradients, as the trainer's
accumulation loop, which averages micro-batch losses. The step's loss (their sum) is broadcast from the
last stage to its whole pipeline, so every rank logs and checks the same number.

Tied embeddings. When a parameter of a first-stage module is also one of a last-stage module (GPT's
`tok_emb.weight` is its `lm_head.weight` with `model.tie_embeddings`), it lives on two ranks here: each
keeps a copy, and after backward their gradients are summed over a two-rank group (first, last) of each
pipeline, so both receive the full gradient and the two optimizer steps stay bit-identical (Megatron's
embedding group).

The plain model is pruned in place to this rank's parameters (modules of other stages set to None), so
`model.state_dict()`, the optimizer and the tensor-parallel helpers see plain names (`layers.5.attn…`)
and only what this rank owns. The cut needs no process group (`cut_stages`): a layout can be planned
on the meta device for any rank without starting the others. Dropout masks differ from the single-process run (each rank draws from
its own generator for its own layers), as in Megatron; with dropout off the runs are equal.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from meshlm.core.config import Config
from meshlm.core.layout import microbatches_per_step, partition_layers, stage_ids, stage_layer_ranges
from meshlm.families.spec import ModelSpec
from meshlm.parallel.grads import local_square_sum
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.tensor_layers import LossFn


def pipeline_layers(cfg: Config, spec) -> list[int]:
    """The layer counts for `cfg`: `parallel.pp_layers` if set, else balanced with the family's
    first/last stage costs counted."""
    p = cfg.parallel
    first, last = spec.stage_costs(cfg.model)
    return partition_layers(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers or None, first, last)


# ---- one stage's module ----------------------------------------------------------------------------------
class StageModule(nn.Module):
    """One virtual stage: [the family's first-stage modules] → its layers → [its last-stage modules].

    Holds the plain model's own submodules (after tensor parallelism swapped them, if it did), so
    gradients and weights are the model's (the pruned model keeps their plain names), and runs the model's
    own `embed`, `run_layers` and `head`. Input: token ids (B, T) on the first stage, the residual stream
    (B, T, h) (or (B, T/t, h) under sequence parallelism) elsewhere; output: the residual stream, or on the
    last stage the output (logits, or with `fused_head` the stream itself, from which the loss function,
    the model's `head_loss`, computes the fused head + loss).
    """

    is_stage = True  # `apply_recompute` wraps `self.layers` (the model's own layer list may have another name)

    def __init__(self, model: nn.Module, spec, layer_ids: range, first: bool, last: bool, fused_head: bool = False):
        super().__init__()
        plan = spec.pipeline
        self.spec = spec
        self.first, self.last, self.layer_ids, self.fused_head = first, last, layer_ids, fused_head
        for name in plan.first if first else ():
            setattr(self, name, getattr(model, name))
        # A list, as the model's: `apply_recompute` wraps a stage's layers as it wraps a whole model's.
        self.layers = nn.ModuleList(getattr(model, plan.layers)[i] for i in layer_ids)
        for name in plan.last if last else ():
            setattr(self, name, getattr(model, name))
        for name in getattr(model, "head_reads", ()) if last and not first else ():  # first-stage modules the
            setattr(self, name, getattr(model, name))  # head also reads (a copy here, its gradient summed: tied)
        # The model's methods (plain attributes: the model is not a submodule of its stage).
        self._embed, self._run_layers, self._head = model.embed, model.run_layers, model.head

    def forward(self, x: torch.Tensor, inputs: torch.Tensor | None = None, **documents) -> torch.Tensor:
        """`inputs`: the micro-batch's inputs, given to every stage of a family with `stage_inputs` (BERT's
        layers need its padding mask). `documents`: packed documents' keyword arguments (the family's
        `document_inputs`: GPT's positions and segments), which the embedding and every layer take."""
        if self.first:  # positions from 0 (training and evaluation see whole sequences), or per token
            x = self._embed(x, **documents)  # (B, T, h), or (B, T/t, h) under sequence parallelism
        x = self._run_layers(x, self.layer_ids, inputs=inputs) if self.spec.stage_inputs else \
            self._run_layers(x, self.layer_ids, **documents)
        if self.last:
            if self.fused_head:
                return x  # (B, T, h): the loss is the model's head_loss
            # logits (B, T, V) or (B, T, V/t) (BERT's head also reads the inputs: its predicted tokens)
            return self._head(x, inputs=inputs) if self.spec.stage_inputs else self._head(x)
        # Sent to the next stage, whose receive buffer torch shapes after this tensor and gloo/NCCL need
        # contiguous (the residual stream can inherit a permuted layout from SP's reduce-scatter).
        return x.contiguous()


def tied_parameter(model: nn.Module, spec) -> tuple[str, str] | None:
    """(first-stage name, last-stage name) of a parameter both ends hold (a tied embedding), or None."""
    plan = spec.pipeline
    firsts = {}
    for m in plan.first:
        if getattr(model, m, None) is not None:
            firsts.update({id(p): n for n, p in getattr(model, m).named_parameters(prefix=m)})
    for m in plan.last:
        if getattr(model, m, None) is not None:
            for n, p in getattr(model, m).named_parameters(prefix=m):
                if id(p) in firsts:
                    return firsts[id(p)], n
    for m in getattr(model, "head_reads", ()):  # a first-stage module the last stage also computes with (GPT's
        for n, _ in getattr(model, m).named_parameters(prefix=m):  # embedding in multi-token prediction): a copy
            return n, n  # on both, kept equal as a tied one
    return None


def _prune(model: nn.Module, spec, owned: set[int], first: bool, last: bool, tied: tuple[str, str] | None) -> None:
    """Drop the modules of other ranks' stages from the plain model (set to None: names stay plain).

    The last stage keeps the first-stage module holding a tied parameter: that parameter *is* its output
    layer's, and keeping the module keeps the parameter's name (and hence its optimizer group, no weight
    decay) as in the plain model.
    """
    plan = spec.pipeline
    layers = getattr(model, plan.layers)
    for i in range(len(layers)):
        if i not in owned:
            layers[i] = None
    keep = tied[0].split(".")[0] if tied is not None and last else None
    for name in plan.first if not first else ():
        if name != keep:
            setattr(model, name, None)
    for name in plan.last if not last else ():
        setattr(model, name, None)


def cut_stages(model: nn.Module, spec, cfg: Config, pp_rank: int, fused: bool):
    """This pipeline rank's stage modules, pruning the model to them (no process group needed).
    Returns (layer counts per virtual stage, this rank's stage ids, modules, tied parameter names)."""
    p = cfg.parallel
    counts = pipeline_layers(cfg, spec)
    ranges = stage_layer_ranges(counts)
    n_stages = p.pp * p.vpp
    ids = stage_ids(pp_rank, p.pp, p.vpp)
    first, last = 0 in ids, n_stages - 1 in ids
    tied = tied_parameter(model, spec)
    modules = [StageModule(model, spec, ranges[s], s == 0, s == n_stages - 1, fused) for s in ids]
    _prune(model, spec, {i for s in ids for i in ranges[s]}, first, last, tied)
    return counts, ids, modules, tied


def rank_at(dims: ParallelDims, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None,
            cp_rank: int | None = None) -> int:
    """Global rank at mesh coordinate (pp, dp, cp, tp) (default: this rank's), by mesh.py's layout
    r = ((pp·D + dp)·C + cp)·T + tp."""
    dp_rank = dims.dp_rank if dp_rank is None else dp_rank
    tp_rank = dims.tp_rank if tp_rank is None else tp_rank
    cp_rank = dims.cp_rank if cp_rank is None else cp_rank
    return ((pp_rank * dims.dp + dp_rank) * dims.cp + cp_rank) * dims.tp + tp_rank


def embedding_group(dims: ParallelDims, timeout_s: float) -> dist.ProcessGroup | None:
    """The two-rank group (first stage, last stage) of this rank's pipeline, for tied embedding gradients.

    Collective: every rank creates every pair (one per dp × cp × tp coordinate), in the same order.
    """
    mine = None
    for d, c, t in itertools.product(range(dims.dp), range(dims.cp), range(dims.tp)):
        ranks = [rank_at(dims, 0, d, t, c), rank_at(dims, dims.pp - 1, d, t, c)]
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        if dims.rank in ranks:
            mine = group
    return mine


def build_schedule(stages: list, m: int, loss_fn: LossFn):
    """1F1B for one stage per rank (GPipe when m < pp, which 1F1B rejects), interleaved 1F1B for several.

    `scale_grads=False`: the loss is already divided by m (see the module docstring).
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if len(stages) > 1:
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
    single = Schedule1F1B if m >= stages[0].num_stages else ScheduleGPipe
    return single(stages[0], m, loss_fn=loss_fn, scale_grads=False)


# ---- this rank's pipeline ---------------------------------------------------------------------------------
class PipelinePeerError(RuntimeError):
    """A neighbouring pipeline rank stopped or did not answer within `parallel.timeout_s`."""


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stage modules, torch's stages and schedule, and groups."""

    dims: ParallelDims
    layer_counts: list[int]  # per virtual stage, in model order
    stage_ids: list[int]  # the virtual stages on this rank: pp_rank, pp_rank + pp, …
    modules: list[StageModule]
    schedule: object  # torch.distributed.pipelining schedule
    loss_fn: LossFn  # the unscaled loss (evaluation)
    n_microbatches: int
    timeout_s: float
    hidden_size: int = 0
    seq_shard: int = 1  # cp (× tp under sequence parallelism): the stream between stages holds T/seq_shard tokens
    tied_group: dist.ProcessGroup | None = None
    tied_weight: nn.Parameter | None = None  # this rank's copy of the tied embedding (first or last stage)
    tied_names: tuple[str, str] | None = None  # its (first-stage, last-stage) names in the plain model
    _step_kwargs: dict = field(default_factory=dict)
    stage_inputs: bool = False  # every stage gets the micro-batch's inputs (`ModelSpec.stage_inputs`)

    @property
    def n_stages(self) -> int:
        return len(self.layer_counts)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    @property
    def last_rank(self) -> int:
        """Global rank holding the last stage in this rank's pipeline (same dp and tp coordinates)."""
        return rank_at(self.dims, self.dims.pp - 1)

    @contextlib.contextmanager
    def _peers(self, what: str) -> Iterator[None]:
        """Turn a failed send/recv/collective into an error that says what happened and what to check."""
        try:
            yield
        except (RuntimeError, dist.DistError) as err:
            if isinstance(err, PipelinePeerError) or not _is_comm_error(err):
                raise
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PipelinePeerError(
                f"pipeline {what} failed on rank {self.dims.rank} (pipeline stage(s) {self.stage_ids}): a "
                f"neighbouring pipeline rank stopped or did not answer within parallel.timeout_s="
                f"{self.timeout_s:g}s; check the other ranks' output for the first error "
                f"[{type(err).__name__}: {first_line}]") from err

    def train_step(self, x: torch.Tensor, y: torch.Tensor, **documents) -> torch.Tensor:
        """Forward and backward of one global batch (m micro-batches stacked on dim 0) through the schedule;
        `documents`: packed documents' per-token tensors (B, T), split with x and given to every stage.

        Returns the mean micro-batch loss on every rank of the pipeline (as the accumulation loop's
        total); leaves the gradients accumulated, tied embedding copies not yet summed (`finish_grads`).
        """
        args = (x,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        # Every stage's forward gets its micro-batch's inputs too when the family needs them (torch splits
        # keyword arguments into micro-batches and passes them to each stage of this rank).
        extra = {"inputs": x} if self.stage_inputs else dict(documents)
        # What records a value per loss call (a PartsLoss; modules such as GPT's multi-token prediction): newer
        # torch calls the loss once more on placeholder tensors, first, at the first step to infer shapes
        recorders = [r for r in (self.loss_fn, *(m for stage in self.modules for m in stage.modules()))
                     if hasattr(r, "recorded") and hasattr(r, "drop")] if self.has_last else []
        held = [r.recorded for r in recorders]
        with self._peers("training step"):
            self.schedule.step(*args, target=y if self.has_last else None,
                               losses=losses if self.has_last else None, **self._step_kwargs, **extra)
            for r, before in zip(recorders, held):  # drop those placeholder calls' records
                r.drop(before, r.recorded - before - self.n_microbatches)
            total = torch.zeros((), dtype=torch.promote_types(torch.get_default_dtype(), torch.float32),
                                device=self.dims.device)
            for loss in losses:  # the accumulation loop's order: the same float sum
                total += loss.detach().to(total.dtype)
            dist.broadcast(total, src=self.last_rank, group=self.dims.pp_group)
        return total

    def finish_grads(self) -> None:
        """Sum the tied embedding's gradient over (first, last): both copies get the full gradient."""
        if self.tied_group is None or self.tied_weight is None:
            return
        w = self.tied_weight
        if not w.requires_grad:  # frozen (an adapter trains instead): no gradient to share
            return
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        with self._peers("tied-embedding gradient all-reduce"):
            dist.all_reduce(w.grad, group=self.tied_group)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """‖∇‖₂ of the whole model: every stage's parameters once (tensor-parallel shards once), the tied
        embedding once (the first stage's copy), summed over tp then pp (`parallel/grads.py`)."""
        square = local_square_sum(model.parameters(), self.dims, self, model)
        with self._peers("gradient-norm all-reduce"):
            if self.dims.tp > 1:
                dist.all_reduce(square, group=self.dims.tp_group)
            dist.all_reduce(square, group=self.dims.pp_group)
        return square.sqrt()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        norm = self.grad_norm(model)
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, **documents) -> torch.Tensor:
        """Loss of one batch, forward only: it passes through the stages in order, one after the other
        (no schedule: evaluation is rare and needs no pipelining). Returned on every rank of the pipeline."""
        d, pp = self.dims, self.dims.pp
        dtype = next(p for m in self.modules for p in m.parameters()).dtype
        shape = (x.shape[0], x.shape[-1] // self.seq_shard, self.hidden_size)  # the stream (ids: (B, T) or (B, k, T))
        loss = torch.zeros((), dtype=torch.promote_types(torch.get_default_dtype(), torch.float32), device=d.device)
        with self._peers("evaluation forward"):
            for k, s in enumerate(self.stage_ids):
                if s == 0:
                    act = x
                else:
                    act = torch.empty(shape, dtype=dtype, device=d.device)
                    dist.recv(act, src=rank_at(d, (s - 1) % pp), group=d.pp_group)
                out = self.modules[k](act, inputs=x) if self.stage_inputs else self.modules[k](act, **documents)
                if s < self.n_stages - 1:
                    dist.send(out.to(dtype).contiguous(), dst=rank_at(d, (s + 1) % pp), group=d.pp_group)
                else:
                    loss = self.loss_fn(out, y).detach().to(loss.dtype)
            dist.broadcast(loss, src=self.last_rank, group=d.pp_group)
        return loss


def _is_comm_error(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def apply_pipeline(model: nn.Module, dims: ParallelDims, cfg: Config, loss_fn: LossFn, *, spec: ModelSpec) -> Pipeline:
    """Cut the (possibly tensor-parallel) plain model into this rank's stages, prune it to them, and build
    the schedule: `cut_stages` then `build_pipeline` (which `parallel.parallelize` calls apart, to
    materialise a meta-built model's shards in between). Every rank must call this (collective)."""
    return build_pipeline(model, spec, dims, cfg, loss_fn, cut_stages(model, spec, cfg, dims.pp_rank,
                                                                      fused_head(cfg, dims, spec)))


def fused_head(cfg: Config, dims: ParallelDims, spec) -> bool:
    """At tp = 1 the last stage fuses its output layer into the loss (`train.fused_loss`; auto: where it wins,
    `models/loss.py`): no logits."""
    from meshlm.models.loss import use_fused_loss

    own_loss = cfg.model.mtp_depth > 0  # multi-token prediction: the model's head_loss at any tp (models/mtp.py)
    return (use_fused_loss(cfg, dims.device) and dims.tp == 1 or own_loss) and spec.fused_loss


def build_pipeline(model: nn.Module, spec, dims: ParallelDims, cfg: Config, loss_fn: LossFn, cut) -> Pipeline:
    """torch's stages and schedule over this rank's stage modules (`cut_stages`' result), and the tied
    embedding's group.

    `loss_fn(output, targets)` is the mean-token loss for the model as parallelized so far (plain or
    vocab-parallel cross-entropy); with a fused head the last stage uses the model's `head_loss` instead.
    Collective: every rank must call it (the tied-embedding groups).
    """
    from torch.distributed.pipelining import PipelineStage

    p = cfg.parallel
    counts, ids, modules, tied = cut
    n_stages = p.pp * p.vpp
    first, last = 0 in ids, n_stages - 1 in ids
    if fused_head(cfg, dims, spec) and last:
        loss_fn = model.head_loss
    group = embedding_group(dims, p.timeout_s) if tied else None
    tied_weight = model.get_parameter(tied[0] if first else tied[1]) if tied and (first or last) else None
    m = microbatches_per_step(cfg, dims.dp)

    def scaled_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) / m  # exactly the accumulation loop's `loss / accum`

    stages = [PipelineStage(mod, s, n_stages, dims.device, group=dims.pp_group) for mod, s in zip(modules, ids)]
    schedule = build_schedule(stages, m, scaled_loss)
    # Newer torch merges the last stage's outputs (all m logits) unless told not to; older has no switch.
    kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}
    return Pipeline(dims, counts, ids, modules, schedule, loss_fn, m, p.timeout_s, cfg.model.hidden_size,
                    (dims.tp if p.sp else 1) * dims.cp, group, tied_weight, tied, kwargs, spec.stage_inputs)
