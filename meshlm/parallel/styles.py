"""Tensor-parallel styles applied: what each style of `families.styles` does to the module it names.

`parallel.tensor.apply_tensor_parallel` walks a family's `tp_plan` and calls `apply_style` on each
matching submodule, which swaps it for its sharded version (`tensor_layers`) or marks its parameters.
The styles themselves (what a family may say) are plain data in `families/styles.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from meshlm.families.styles import (
    ColumnParallel,
    HeadParallelAttention,
    HeadParallelLatentAttention,
    RowParallel,
    SequenceDropout,
    SequenceGathered,
    SequenceParallel,
    SequenceShardedPositions,
    Style,
    VocabParallel,
)
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor_layers import (
    ColumnParallelLinear,
    CopyToTensorRegion,
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


def _swap(parent: nn.Module, attr: str, path: str, new: nn.Module, ctx: TPContext) -> None:
    ctx.replaced[path] = getattr(parent, attr)
    setattr(parent, attr, new)


def _in_tp_rng(rng: TPRNGTracker, fn, *args, **kwargs):
    with rng.tp_rng():
        return fn(*args, **kwargs)


def _vocab_parallel(self: VocabParallel, model, parent, attr, path, ctx):
    dense = getattr(parent, attr)
    _swap(parent, attr, path, VocabParallelEmbedding.from_dense(dense, ctx.group, ctx.sp, ctx.t, ctx.rank), ctx)


def _column_parallel(self: ColumnParallel, model, parent, attr, path, ctx):
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


def _row_parallel(self: RowParallel, model, parent, attr, path, ctx):
    dense: nn.Linear = getattr(parent, attr)
    cols = block_rows([dense.in_features], ctx.t)
    _swap(parent, attr, path, RowParallelLinear.from_dense(dense, ctx.group, cols, ctx.sp, ctx.rank), ctx)


def _head_parallel_attention(self: HeadParallelAttention, model, parent, attr, path, ctx):
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
    if getattr(attn, "sinks", None) is not None:  # gpt-oss's sink logits: whole on every rank (summed below),
        attn.head_offset = rank * (nh // t)  # each rank's core reads its heads' entries
    for name, p in attn.named_parameters():  # per-head norms (Qwen3's q_norm, k_norm), sinks: whole on every rank, but
        if not name.startswith((f"{self.qkv}.", f"{self.proj}.")):  # fed by this rank's heads: summed over tp
            p.sequence_parallel = True
    if attn.dropout > 0:  # the core holds this rank's heads: per-rank masks
        core = getattr(attn, self.core)
        setattr(attn, self.core, functools.wraps(core)(functools.partial(_in_tp_rng, ctx.rng, core)))


def _head_parallel_latent_attention(self: HeadParallelLatentAttention, model, parent, attr, path, ctx):
    attn = getattr(parent, attr)
    t, rank = ctx.t, ctx.rank
    if ctx.sp:  # the replicated down projections need every token: gathered once, whole gradient kept per rank
        _swap(attn, "gather_input", f"{path}.gather_input", SequenceGather(ctx.group), ctx)
    for name in self.heads:
        dense = getattr(attn, name, None)
        if dense is not None:  # input already whole: no sequence gather of its own
            new = ColumnParallelLinear.from_dense(dense, ctx.group, block_rows([dense.out_features], t), False,
                                                  rank=rank)
            _swap(attn, name, f"{path}.{name}", new, ctx)
    dense = getattr(attn, self.proj)
    proj = RowParallelLinear.from_dense(dense, ctx.group, block_rows([dense.in_features], t), ctx.sp, rank)
    _swap(attn, self.proj, f"{path}.{self.proj}", proj, ctx)
    _swap(attn, "rope_key_region", f"{path}.rope_key_region", CopyToTensorRegion(ctx.group), ctx)
    attn.n_heads = attn.n_kv_heads = attn.n_heads // t
    if attn.dropout > 0:
        core = getattr(attn, self.core)
        setattr(attn, self.core, functools.wraps(core)(functools.partial(_in_tp_rng, ctx.rng, core)))


def _sequence_parallel(self: SequenceParallel, model, parent, attr, path, ctx):
    if ctx.sp:
        for p in getattr(parent, attr).parameters():
            p.sequence_parallel = True


def _sequence_dropout(self: SequenceDropout, model, parent, attr, path, ctx):
    drop = getattr(parent, attr)
    if ctx.sp and drop is not None:
        _swap(parent, attr, path, TPRegionDropout(drop.p, ctx.rng), ctx)


def _sequence_gathered(self: SequenceGathered, model, parent, attr, path, ctx):
    if ctx.sp and getattr(parent, attr) is not None:
        _swap(parent, attr, path, SequenceGather(ctx.group), ctx)


def _sequence_sharded_positions(self: SequenceShardedPositions, model, parent, attr, path, ctx):
    emb = getattr(parent, attr)
    if ctx.sp and emb is not None:
        _swap(parent, attr, path, SequenceShardedEmbedding(emb, ctx.group, ctx.t, ctx.rank), ctx)


_APPLY = {
    VocabParallel: _vocab_parallel,
    ColumnParallel: _column_parallel,
    RowParallel: _row_parallel,
    HeadParallelAttention: _head_parallel_attention,
    HeadParallelLatentAttention: _head_parallel_latent_attention,
    SequenceParallel: _sequence_parallel,
    SequenceDropout: _sequence_dropout,
    SequenceGathered: _sequence_gathered,
    SequenceShardedPositions: _sequence_sharded_positions,
}


def apply_style(style: Style, model: nn.Module, parent: nn.Module, attr: str, path: str, ctx: TPContext) -> None:
    """Transform the module at `path` of `model` (set on `parent` as `attr`) as `style` says."""
    apply = _APPLY.get(type(style))
    if apply is None:
        raise TypeError(f"{type(style).__name__} is not a tensor-parallel style of families.styles; a family's "
                        "tp_plan names the styles defined there")
    apply(style, model, parent, attr, path, ctx)
