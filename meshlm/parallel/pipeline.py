"""Pipeline parallelism (Narayanan et al. 2021): the layers cut into `pp × vpp` stages, micro-batches run
through them by `torch.distributed.pipelining`'s 1F1B or interleaved-1F1B schedule.

Layout. The model is cut into S = pp·vpp *virtual stages* of consecutive layers; stage s lives on pipeline
rank s mod pp (with vpp = 1 that is just stage r on rank r). Stage 0 also holds the token and position
embeddings, stage S−1 the final norm and the LM head. `partition_layers` balances the layer counts with
that extra work counted, or takes `parallel.pp_layers` as given.

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

Tied embeddings. With `model.tie_embeddings`, the first stage's `tok_emb.weight` and the last stage's
`lm_head.weight` are one parameter in the plain model but live on two ranks here: each keeps a copy, and
after backward their gradients are summed over a two-rank group (first, last) of each pipeline, so both
receive the full gradient and the two optimizer steps stay bit-identical (Megatron's embedding group).

The plain `GPT` is pruned in place to this rank's parameters (modules of other stages set to None), so
`model.state_dict()`, the optimizer and the tensor-parallel helpers see plain names (`layers.5.attn…`)
and only what this rank owns. Dropout masks differ from the single-process run (each rank draws from
its own generator for its own layers), as in Megatron; with dropout off the runs are equal.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import Config, ConfigError, ModelConfig
from meshlm.models.loss import linear_cross_entropy
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.tensor import LossFn
from meshlm.parallel.tensor import grad_norm as tp_grad_norm


# ---- the layer partition (pure data) ---------------------------------------------------------------------
def stage_costs(m: ModelConfig) -> tuple[float, float]:
    """(first, last) stage's extra work in layer-equivalents of forward+backward FLOPs per token.

    One layer: its matmuls (`layer_flops_per_token`) plus causal attention scores, 6·s·k·a (FORMULAS.md).
    First stage: the embedding lookups are gathers, no FLOPs: 0. Last stage: the LM head, 6·h·V (the final
    norm and the cross-entropy are O(h + V), negligible). E.g. gpt2-1.3b: the head ≈ 2 layers.
    """
    from meshlm.train.metrics import layer_flops_per_token  # metrics imports torch only; no cycle

    layer = layer_flops_per_token(m) + 6.0 * m.seq_len * m.head_dim * m.n_heads
    return 0.0, 6.0 * m.hidden_size * m.vocab_size / layer


def partition_layers(n_layers: int, pp: int, vpp: int = 1, explicit: list[int] | None = None,
                     first_cost: float = 0.0, last_cost: float = 0.0) -> list[int]:
    """Layers per virtual stage, in model order (length pp·vpp; stage s runs on pipeline rank s mod pp).

    `explicit` (`parallel.pp_layers`) is validated and returned. Otherwise every stage gets one layer and
    each further layer goes to the currently cheapest stage, the cost of a stage being its layers plus
    `first_cost` (stage 0) or `last_cost` (stage S−1) in layer-equivalents. Adding unit weights one at a
    time to the minimum minimises the maximum stage cost; ties go to the later stage, because the early
    stages of 1F1B hold the most micro-batches' activations. 30 layers on 4 stages with a head of 0.25
    layers: [7, 8, 8, 7]. The result always sums to `n_layers` with ≥ 1 layer per stage, so no layout can
    drop or duplicate a layer (`stage_layer_ranges` turns counts into ranges).
    """
    stages = pp * vpp
    if explicit:
        counts = [int(c) for c in explicit]
        if len(counts) != stages:
            raise ConfigError(f"parallel.pp_layers={counts} has {len(counts)} entries but parallel.pp={pp} × "
                              f"parallel.vpp={vpp} = {stages} stages; give one layer count per stage")
        if min(counts) < 1:
            raise ConfigError(f"parallel.pp_layers={counts}: every stage needs at least 1 layer")
        if sum(counts) != n_layers:
            raise ConfigError(f"parallel.pp_layers={counts} sums to {sum(counts)} but model.n_layers={n_layers}; "
                              "the counts must add up to the number of layers")
        return counts
    if n_layers < stages:
        raise ConfigError(f"model.n_layers={n_layers} is fewer than parallel.pp={pp} × parallel.vpp={vpp} = "
                          f"{stages} stages; every stage needs a layer: lower parallel.pp or parallel.vpp")
    counts = [1] * stages
    extra = [0.0] * stages
    extra[0] += first_cost
    extra[-1] += last_cost
    for _ in range(n_layers - stages):
        cheapest = min(range(stages), key=lambda s: (counts[s] + extra[s], -s))
        counts[cheapest] += 1
    return counts


def stage_layer_ranges(counts: list[int]) -> list[range]:
    """[3, 2, 2] → [range(0, 3), range(3, 5), range(5, 7)]: consecutive, disjoint, covering."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [range(start, start + c) for start, c in zip(starts, counts)]


def pipeline_layers(cfg: Config) -> list[int]:
    """The layer counts for `cfg`: `parallel.pp_layers` if set, else balanced with the head's cost counted."""
    p = cfg.parallel
    first, last = stage_costs(cfg.model)
    return partition_layers(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers or None, first, last)


def n_microbatches(cfg: Config, dp: int = 1) -> int:
    """Micro-batches per step and pipeline: global_batch_size / (micro_batch_size · dp)."""
    t = cfg.train
    per_pipeline = t.micro_batch_size * dp
    if t.global_batch_size % per_pipeline:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
                          f"{t.micro_batch_size} × dp={dp}; set it to a multiple of {per_pipeline}")
    m = t.global_batch_size // per_pipeline
    pp, vpp = cfg.parallel.pp, cfg.parallel.vpp
    if vpp > 1 and m % pp:
        raise ConfigError(f"the interleaved schedule (parallel.vpp={vpp}) needs the micro-batches per step, "
                          f"train.global_batch_size / (micro_batch_size · dp) = {m}, to be a multiple of "
                          f"parallel.pp={pp}; set train.global_batch_size to a multiple of "
                          f"{pp * per_pipeline}")
    return m


# ---- one stage's module ----------------------------------------------------------------------------------
class StageModule(nn.Module):
    """One virtual stage of a GPT: [embeddings] → its layers → [final norm → LM head].

    Holds the plain model's own submodules (after tensor parallelism swapped them, if it did), so
    gradients and weights are the model's (the pruned model keeps their plain names). Input: token ids (B, T) on the first stage, the
    residual stream (B, T, h) (or (B, T/t, h) under sequence parallelism) elsewhere; output: the residual
    stream, or on the last stage the logits (or, with `fused_head`, the final norm's output, from which the
    loss function computes the fused chunked head + cross-entropy: `models/loss.py`).
    """

    def __init__(self, model: nn.Module, layer_ids: range, first: bool, last: bool, fused_head: bool = False):
        super().__init__()
        self.first, self.last, self.layer_ids, self.fused_head = first, last, layer_ids, fused_head
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        # A list, as GPT.layers: `apply_recompute` wraps a stage's layers as it wraps a whole model's.
        self.layers = nn.ModuleList(model.layers[i] for i in layer_ids)
        if last:
            self.norm, self.lm_head = model.norm, model.lm_head
        self.rope = (model.rope_cos, model.rope_sin) if model.cfg.position == "rope" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # as GPT.embed, positions from 0 (training and evaluation see whole sequences)
            ids = x
            x = self.tok_emb(ids)  # (B, T, h), or (B, T/t, h) under sequence parallelism
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
            x = self.drop(x)
        for layer in self.layers:
            x = layer(x, self.rope)
        if self.last:
            x = self.norm(x)
            return x if self.fused_head else self.lm_head(x)  # (B, T, h), or logits (B, T, V) or (B, T, V/t)
        # Sent to the next stage, whose receive buffer torch shapes after this tensor and gloo/NCCL need
        # contiguous (the residual stream can inherit a permuted layout from SP's reduce-scatter).
        return x.contiguous()


def _prune(model: nn.Module, owned: set[int], first: bool, last: bool, tied: bool) -> None:
    """Drop the modules of other ranks' stages from the plain model (set to None: names stay plain).

    The last stage keeps `tok_emb` when the embeddings are tied: its weight *is* `lm_head.weight`, and
    keeping the module keeps the parameter's name (and hence its optimizer group, no weight decay) as in
    the plain model.
    """
    for i in range(len(model.layers)):
        if i not in owned:
            model.layers[i] = None
    if not first:
        model.pos_emb = None
        if not (last and tied):
            model.tok_emb = None
    if not last:
        model.norm = None
        model.lm_head = None


def _rank_at(dims: ParallelDims, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
    """Global rank at mesh coordinate (pp, dp, tp), by mesh.py's layout r = (pp·D + dp)·T + tp."""
    dp_rank = dims.dp_rank if dp_rank is None else dp_rank
    tp_rank = dims.tp_rank if tp_rank is None else tp_rank
    return (pp_rank * dims.dp + dp_rank) * dims.tp + tp_rank


def embedding_group(dims: ParallelDims, timeout_s: float) -> dist.ProcessGroup | None:
    """The two-rank group (first stage, last stage) of this rank's pipeline, for tied embedding gradients.

    Collective: every rank creates every pair (one per dp × tp coordinate), in the same order.
    """
    mine = None
    for d in range(dims.dp):
        for t in range(dims.tp):
            ranks = [_rank_at(dims, 0, d, t), _rank_at(dims, dims.pp - 1, d, t)]
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
    seq_shard: int = 1  # tp under sequence parallelism: the stream between stages holds T/seq_shard tokens
    tied_group: dist.ProcessGroup | None = None
    tied_weight: nn.Parameter | None = None  # this rank's copy of the tied embedding (first or last stage)
    _step_kwargs: dict = field(default_factory=dict)

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
        return _rank_at(self.dims, self.dims.pp - 1)

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

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one global batch (m micro-batches stacked on dim 0) through the schedule.

        Returns the mean micro-batch loss on every rank of the pipeline (as the accumulation loop's
        total); leaves the gradients accumulated, tied embedding copies not yet summed (`finish_grads`).
        """
        args = (x,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        with self._peers("training step"):
            self.schedule.step(*args, target=y if self.has_last else None,
                               losses=losses if self.has_last else None, **self._step_kwargs)
            total = torch.zeros((), device=self.dims.device)
            for loss in losses:  # the accumulation loop's order: the same float sum
                total += loss.detach().float()
            dist.broadcast(total, src=self.last_rank, group=self.dims.pp_group)
        return total

    def finish_grads(self) -> None:
        """Sum the tied embedding's gradient over (first, last): both copies get the full gradient."""
        if self.tied_group is None or self.tied_weight is None:
            return
        w = self.tied_weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        with self._peers("tied-embedding gradient all-reduce"):
            dist.all_reduce(w.grad, group=self.tied_group)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """‖∇‖₂ of the whole model: every stage's parameters once (tensor-parallel shards once, via
        `tensor.grad_norm`), the tied embedding once (the last stage's copy is left out), summed over pp."""
        hidden = self.tied_weight if (self.tied_weight is not None and not self.has_first) else None
        saved = hidden.grad if hidden is not None else None
        if hidden is not None:
            hidden.grad = None
        try:
            local = tp_grad_norm(model, self.dims)
        finally:
            if hidden is not None:
                hidden.grad = saved
        square = local.pow(2)
        with self._peers("gradient-norm all-reduce"):
            dist.all_reduce(square, group=self.dims.pp_group)
        return square.sqrt()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        norm = self.grad_norm(model)
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Loss of one batch, forward only: it passes through the stages in order, one after the other
        (no schedule: evaluation is rare and needs no pipelining). Returned on every rank of the pipeline."""
        d, pp = self.dims, self.dims.pp
        dtype = next(p for m in self.modules for p in m.parameters()).dtype
        shape = (x.shape[0], x.shape[1] // self.seq_shard, self.hidden_size)  # the stream between stages
        loss = torch.zeros((), device=d.device)
        with self._peers("evaluation forward"):
            for k, s in enumerate(self.stage_ids):
                if s == 0:
                    act = x
                else:
                    act = torch.empty(shape, dtype=dtype, device=d.device)
                    dist.recv(act, src=_rank_at(d, (s - 1) % pp), group=d.pp_group)
                out = self.modules[k](act)
                if s < self.n_stages - 1:
                    dist.send(out.to(dtype).contiguous(), dst=_rank_at(d, (s + 1) % pp), group=d.pp_group)
                else:
                    loss = self.loss_fn(out, y).detach().float()
            dist.broadcast(loss, src=self.last_rank, group=d.pp_group)
        return loss


def _is_comm_error(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def apply_pipeline(model: nn.Module, dims: ParallelDims, cfg: Config, loss_fn: LossFn) -> Pipeline:
    """Cut the (possibly tensor-parallel) plain `GPT` into this rank's stages; prune it to them; the
    returned `Pipeline` is also left at `model.pipeline`.

    `loss_fn(logits, targets)` is the mean-token loss for the model as parallelized so far (plain or
    vocab-parallel cross-entropy); at tp = 1 with `train.fused_loss` the last stage uses the fused head +
    loss instead. Every rank must call this (the tied-embedding group is collective).
    """
    from torch.distributed.pipelining import PipelineStage

    p = cfg.parallel
    counts = pipeline_layers(cfg)
    ranges = stage_layer_ranges(counts)
    n_stages = p.pp * p.vpp
    stage_ids = [dims.pp_rank + k * dims.pp for k in range(p.vpp)]
    tied = model.lm_head.weight is model.tok_emb.weight
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    # At tp = 1 the last stage fuses its head into the loss (train.fused_loss): no (tokens × vocab) logits.
    fused = cfg.train.fused_loss and dims.tp == 1
    if fused and last:
        head = model.lm_head

        def loss_fn(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return linear_cross_entropy(hidden, head.weight, targets)
    modules = [StageModule(model, ranges[s], s == 0, s == n_stages - 1, fused) for s in stage_ids]
    _prune(model, {i for s in stage_ids for i in ranges[s]}, first, last, tied)
    group = embedding_group(dims, p.timeout_s) if tied else None
    tied_weight = model.tok_emb.weight if tied and (first or last) else None
    m = n_microbatches(cfg, dims.dp)

    def scaled_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) / m  # exactly the accumulation loop's `loss / accum`

    stages = [PipelineStage(mod, s, n_stages, dims.device, group=dims.pp_group) for mod, s in zip(modules, stage_ids)]
    schedule = build_schedule(stages, m, scaled_loss)
    # Newer torch merges the last stage's outputs (all m logits) unless told not to; older has no switch.
    kwargs = {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}
    pipeline = Pipeline(dims, counts, stage_ids, modules, schedule, loss_fn, m, p.timeout_s, cfg.model.hidden_size,
                        dims.tp if p.sp else 1, group, tied_weight, kwargs)
    model.pipeline = pipeline  # where the trainer finds this rank's stages and schedule (a plain attribute)
    return pipeline
