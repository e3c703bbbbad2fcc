"""Tensor-parallel styles: what a model family's plan says of each of its submodules.

A family's `ModelSpec.tp_plan(cfg)` maps module paths (`fnmatch` patterns: `layers.*.mlp.fc`) to one of
these styles, in the order they are applied; `parallel.tensor.apply_tensor_parallel` walks the plan and
lets each style swap or mark the module it names. Nothing here knows a family's attribute names: a
style only relies on the kind of module it is given (an `nn.Linear`, an `nn.Embedding`, a norm, a
dropout, or an attention module with fused `[W_q; W_k; W_v]` input and an output projection).

Styles whose name starts with `Sequence` act only under sequence parallelism (`parallel.sp`): the
residual stream between layers is split along the sequence, so norms see a part of the tokens (their
gradients are summed over tp), dropout must draw different masks per rank, and learned positions are
looked up for this rank's tokens only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceGather,
    SequenceShardedEmbedding,
    TPRegionDropout,
    VocabParallelEmbedding,
    block_rows,
    qkv_rows,
)


@dataclass
class TPContext:
    """What every style needs: the group (None when a layout is only planned), tp size and this rank's index,
    sequence parallelism, the tp dropout stream, and the modules already replaced (path → the dense one)."""

    group: object
    t: int
    rank: int
    sp: bool
    rng: TPRNGTracker | None
    replaced: dict[str, nn.Module] = field(default_factory=dict)
    vocab_parallel_output: bool = False  # some output layer's logits are split over the vocabulary


class Style:
    """Transforms the module at `path` of `model` (set on `parent` as `attr`)."""

    def apply(self, model: nn.Module, parent: nn.Module, attr: str, path: str, ctx: TPContext) -> None:
        raise NotImplementedError


def _swap(parent: nn.Module, attr: str, path: str, new: nn.Module, ctx: TPContext) -> None:
    ctx.replaced[path] = getattr(parent, attr)
    setattr(parent, attr, new)


@dataclass(frozen=True)
class VocabParallel(Style):
    """An `nn.Embedding` over the vocabulary: rows split over tp (padded); the output is summed over tp, or
    reduce-scattered along the sequence under SP."""

    def apply(self, model, parent, attr, path, ctx):
        dense = getattr(parent, attr)
        _swap(parent, attr, path, VocabParallelEmbedding.from_dense(dense, ctx.group, ctx.sp, ctx.t, ctx.rank), ctx)


@dataclass(frozen=True)
class ColumnParallel(Style):
    """An `nn.Linear` split by output rows. `blocks`: row counts of blocks stacked along the output
    ([W_gate; W_up]): each rank takes its slice of every block. `vocab_of`: an output layer over the
    vocabulary of that `VocabParallel` embedding: the same (padded) rows, and the same parameter when
    the plain model ties them; its logits stay split over the vocabulary."""

    blocks: tuple[int, ...] | None = None
    vocab_of: str | None = None
    gather_sequence: bool = True  # under SP, all-gather the sequence-split input (False: it is whole already)

    def apply(self, model, parent, attr, path, ctx):
        dense: nn.Linear = getattr(parent, attr)
        weight = None
        if self.vocab_of is not None:
            emb = model.get_submodule(self.vocab_of)
            rows = emb.vocab_rows
            if dense.weight is ctx.replaced[self.vocab_of].weight:  # tied in the plain model: one shard
                weight = emb.weight
            ctx.vocab_parallel_output = True
        else:
            rows = block_rows(list(self.blocks or (dense.out_features,)), ctx.t)
        new = ColumnParallelLinear.from_dense(dense, ctx.group, rows, ctx.sp and self.gather_sequence, weight=weight,
                                              rank=ctx.rank)
        _swap(parent, attr, path, new, ctx)


@dataclass(frozen=True)
class RowParallel(Style):
    """An `nn.Linear` split by input columns; the partial products are summed over tp (reduce-scattered
    along the sequence under SP); the bias is added once, after the sum."""

    def apply(self, model, parent, attr, path, ctx):
        dense: nn.Linear = getattr(parent, attr)
        cols = block_rows([dense.in_features], ctx.t)
        _swap(parent, attr, path, RowParallelLinear.from_dense(dense, ctx.group, cols, ctx.sp, ctx.rank), ctx)


@dataclass(frozen=True)
class HeadParallelAttention(Style):
    """Attention split by heads (Megatron): the fused `qkv` column-parallel by query and KV heads, `proj`
    row-parallel, the core on this rank's heads (drawing its dropout from the tp stream).

    The module must hold `n_heads`, `n_kv_heads`, `head_dim`, `dropout` (the core's probability) and the
    linears named by `qkv` and `proj`, with `qkv.weight = [W_q; W_k; W_v]`. KV heads are split when tp
    divides them; when tp is a multiple of n_kv_heads each rank holds the one KV head its query heads use,
    so t/n_kv_heads ranks hold a copy (their gradients are summed by `finish_grads`, counted once in the norm).
    """

    qkv: str = "qkv"
    proj: str = "proj"
    core: str = "core"

    def apply(self, model, parent, attr, path, ctx):
        attn = getattr(parent, attr)
        t, rank = ctx.t, ctx.rank
        nh, nkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        qkv = ColumnParallelLinear.from_dense(getattr(attn, self.qkv), ctx.group, qkv_rows(nh, nkv, hd, t), ctx.sp,
                                              rank=rank)
        _swap(attn, self.qkv, f"{path}.{self.qkv}", qkv, ctx)
        if t > nkv:  # each KV head is held by t/nkv ranks
            j, q_local = rank * nkv // t, nh // t * hd
            local = torch.arange(q_local, q_local + 2 * hd)  # this rank's K rows then V rows
            compact = torch.cat([torch.arange(j * hd, (j + 1) * hd),
                                 torch.arange((nkv + j) * hd, (nkv + j + 1) * hd)])
            qkv.share_rows(local, compact, 2 * nkv * hd, owner=rank % (t // nkv) == 0)
        proj = RowParallelLinear.from_dense(getattr(attn, self.proj), ctx.group, block_rows([nh * hd], t), ctx.sp,
                                            rank)
        _swap(attn, self.proj, f"{path}.{self.proj}", proj, ctx)
        attn.n_heads, attn.n_kv_heads = nh // t, max(1, nkv // t)  # the heads this rank computes
        if attn.dropout > 0:  # the core holds this rank's heads: per-rank masks
            core = getattr(attn, self.core)
            setattr(attn, self.core, functools.wraps(core)(functools.partial(_in_tp_rng, ctx.rng, core)))


def _in_tp_rng(rng: TPRNGTracker, fn, *args, **kwargs):
    with rng.tp_rng():
        return fn(*args, **kwargs)


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A module that works per token (a norm) on the sequence-split stream: its parameters see only this
    rank's tokens, so their gradients are summed over tp (`finish_grads`)."""

    def apply(self, model, parent, attr, path, ctx):
        if ctx.sp:
            for p in getattr(parent, attr).parameters():
                p.sequence_parallel = True


@dataclass(frozen=True)
class SequenceDropout(Style):
    """Dropout on the sequence-split stream: masks from this rank's tp stream."""

    def apply(self, model, parent, attr, path, ctx):
        drop = getattr(parent, attr)
        if ctx.sp and drop is not None:
            _swap(parent, attr, path, TPRegionDropout(drop.p, ctx.rng), ctx)


@dataclass(frozen=True)
class SequenceGathered(Style):
    """A marker module (`nn.Identity`) before modules every tp rank computes whole (BERT's pooler and
    task heads): under SP it gathers the sequence-split stream (`tensor_layers.SequenceGather`)."""

    def apply(self, model, parent, attr, path, ctx):
        if ctx.sp and getattr(parent, attr) is not None:
            _swap(parent, attr, path, SequenceGather(ctx.group), ctx)


@dataclass(frozen=True)
class SequenceShardedPositions(Style):
    """A small table under SP (learned positions, token types): whole on every rank, looked up for this
    rank's tokens."""

    def apply(self, model, parent, attr, path, ctx):
        emb = getattr(parent, attr)
        if ctx.sp and emb is not None:
            _swap(parent, attr, path, SequenceShardedEmbedding(emb, ctx.group, ctx.t, ctx.rank), ctx)
