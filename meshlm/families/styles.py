"""Tensor-parallel styles: what a model family's plan says of each of its submodules (declarations only).

A family's `ModelSpec.tp_plan(cfg)` maps module paths (`fnmatch` patterns: `layers.*.mlp.fc`) to one of
these styles, in the order they are applied. A style here is plain data: it names the kind of split and
its parameters. `parallel.styles` holds what each style does to a module (`parallel.tensor.
apply_tensor_parallel` walks the plan), so a family describes its split without importing `parallel/`.
Nothing here knows a family's attribute names: a style only relies on the kind of module it is given (an
`nn.Linear`, an `nn.Embedding`, a norm, a dropout, or an attention module with fused `[W_q; W_k; W_v]`
input and an output projection).

Styles whose name starts with `Sequence` act only under sequence parallelism (`parallel.sp`): the
residual stream between layers is split along the sequence, so norms see a part of the tokens (their
gradients are summed over tp), dropout must draw different masks per rank, and learned positions are
looked up for this rank's tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass


class Style:
    """A tensor-parallel style (see the module docstring); `parallel.styles.apply_style` applies it."""



@dataclass(frozen=True)
class VocabParallel(Style):
    """An `nn.Embedding` over the vocabulary: rows split over tp (padded); the output is summed over tp, or
    reduce-scattered along the sequence under SP."""


@dataclass(frozen=True)
class ColumnParallel(Style):
    """An `nn.Linear` split by output rows. `blocks`: row counts of blocks stacked along the output
    ([W_gate; W_up]): each rank takes its slice of every block. `vocab_of`: an output layer over the
    vocabulary of that `VocabParallel` embedding: the same (padded) rows, and the same parameter when
    the plain model ties them; its logits stay split over the vocabulary."""

    blocks: tuple[int, ...] | None = None
    vocab_of: str | None = None
    gather_sequence: bool = True  # under SP, all-gather the sequence-split input (False: it is whole already)


@dataclass(frozen=True)
class RowParallel(Style):
    """An `nn.Linear` split by input columns; the partial products are summed over tp (reduce-scattered
    along the sequence under SP); the bias is added once, after the sum."""


@dataclass(frozen=True)
class HeadParallelAttention(Style):
    """Attention split by heads (Megatron): the fused `qkv` column-parallel by query and KV heads, `proj`
    row-parallel, the core on this rank's heads (drawing its dropout from the tp stream).

    The module must hold `n_heads`, `n_kv_heads`, `head_dim`, `dropout` (the core's probability) and the
    linears named by `qkv` and `proj`, with `qkv.weight = [W_q; W_k; W_v]`. KV heads are split when tp
    divides them; when tp is a multiple of n_kv_heads each rank holds the one KV head its query heads use,
    so t/n_kv_heads ranks hold a copy (their gradients are summed by `finish_grads`, counted once in the norm).
    Any other parameter of the module (Qwen3's per-head `q_norm`, `k_norm`, head_dim wide) stays whole on every
    rank and sees only this rank's heads: its gradient is summed over tp, as a sequence-parallel norm's.
    """

    qkv: str = "qkv"
    proj: str = "proj"
    core: str = "core"


@dataclass(frozen=True)
class HeadParallelLatentAttention(Style):
    """Multi-head latent attention (DeepSeek's MLA) split by heads: the linears named in `heads` (those the module
    has) column-parallel, their rows head-major; `proj` row-parallel; the down projections and latent norms
    replicated and computed whole on every rank (their gradients are whole: what follows them is column-parallel).
    The module holds `n_heads`, `n_kv_heads`, `dropout`, the core named `core`, and two identity slots the split
    fills: `gather_input` (under SP: the sequence gathered for the replicated projections) and `rope_key_region`
    (Megatron's `f` on the rope key all heads share, so its gradient is summed over the ranks' heads)."""

    heads: tuple[str, ...] = ("q", "q_up", "kv_up")
    proj: str = "proj"
    core: str = "core"


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A module that works per token (a norm) on the sequence-split stream: its parameters see only this
    rank's tokens, so their gradients are summed over tp (`finish_grads`)."""


@dataclass(frozen=True)
class SequenceDropout(Style):
    """Dropout on the sequence-split stream: masks from this rank's tp stream."""


@dataclass(frozen=True)
class SequenceGathered(Style):
    """A marker module (`nn.Identity`) before modules every tp rank computes whole (BERT's pooler and
    task heads): under SP it gathers the sequence-split stream (`tensor_layers.SequenceGather`)."""


@dataclass(frozen=True)
class SequenceShardedPositions(Style):
    """A small table under SP (learned positions, token types): whole on every rank, looked up for this
    rank's tokens."""
