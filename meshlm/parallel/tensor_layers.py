"""Tensor-parallel building blocks: collectives as autograd functions, parallel layers, vocab-parallel loss.

Megatron tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

Every collective is a small autograd function over an explicit tp process group, so a debugger can step
through the communication on CPU. With t ranks and a linear layer Y = XA:

* column parallel: A = [A_1 … A_t] split by output columns; rank i computes Y_i = X A_i. X is needed
  whole on every rank, so it enters through `f` (identity forward, all-reduce backward, because
  ∂L/∂X = Σ_i ∂L/∂Y_i A_iᵀ sums contributions from every rank).
* row parallel: A = [A_1; …; A_t] split by input rows, X = [X_1 … X_t] arrives split by columns (the output
  of a column-parallel layer); Y = Σ_i X_i A_i leaves through `g` (all-reduce forward, identity
  backward). `f` and `g` are conjugate: each is the other's transpose.
* sequence parallel: between layers the activations (norms, dropout, residual adds) are split along the
  sequence instead of replicated. `g` becomes a reduce-scatter along the sequence and `f` an all-gather;
  their backwards swap (all-gather ↔ reduce-scatter). Same bytes on the wire as the two all-reduces, since
  an all-reduce *is* a reduce-scatter followed by an all-gather, but the norms/dropout/residual work and
  memory are divided by t. A column-parallel linear under SP fuses its all-gather with the matmul
  (`_GatherSeqLinear`): it keeps only the sequence shard of its input for the weight gradient and
  all-gathers it again in backward (Megatron's choice), so that activation too is divided by t, for one
  more all-gather per column-parallel linear in backward.

An attention + MLP block therefore communicates twice forward and twice backward (under SP, plus the two
re-gathers of the qkv and fc inputs in backward). The embedding is vocab-parallel (each rank holds V/t
rows, out-of-range ids give zeros, then `g`); the LM head is a column-parallel linear whose logits stay
split over the vocabulary, and the cross-entropy is computed from the shards (max, then sum-exp and target
logit all-reduces) without ever gathering (B, T, V).

`parallel.tensor.apply_tensor_parallel` swaps a plain model's modules for these, as the model family's
plan says (`parallel/styles.py`); `models/` stays single-device. A layer knows its group, the tp size and
its rank in it, and which rows (or columns) of the full tensor it holds: that is enough to slice an
initialised dense layer, to make a shard on the meta device and initialise only it (`models/init.py`),
to gather the full tensor back, and to read or write its part of a layout-free checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.models.loss import IGNORE_INDEX
from meshlm.parallel.rng import TPRNGTracker

SEQ_DIM = 1  # activations are (B, T, h): the sequence is dim 1

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The names on `torch.distributed` of the tensor all-gather and reduce-scatter (`getattr(dist, ALL_GATHER)(out,
# inp, group=...)`): torch 2.12 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old
# names warn). Looked up on `dist` at call time, so benchmarks/tp_comm.py can wrap them to count bytes.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


# ---- collectives as autograd functions -------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous().clone()  # never reduce in place into a tensor autograd may still hold
    dist.all_reduce(x, op=op, group=group)
    return x


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, …) on every rank → (B, T, …), rank i's chunk at positions [i·T/t, (i+1)·T/t)."""
    out, _ = _start_gather_seq_first(x, group, async_op=False)
    return out.movedim(0, SEQ_DIM)


def _start_gather_seq_first(x: torch.Tensor, group, async_op: bool):
    """All-gather (B, T/t, …) along the sequence into a (T, B, …) tensor (sequence first, contiguous);
    with `async_op` the result is valid only after the returned work handle's `wait()`."""
    part = x.movedim(SEQ_DIM, 0).contiguous()  # (T/t, B, …): the gathered dim must lead
    out = part.new_empty((group.size() * part.shape[0], *part.shape[1:]))  # (T, B, …)
    work = getattr(dist, ALL_GATHER)(out, part, group=group, async_op=async_op)
    return out, work


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, …) partial sums on every rank → (B, T/t, …): this rank's positions, summed over ranks."""
    out, _ = _start_reduce_scatter_seq_first(x.movedim(SEQ_DIM, 0).contiguous(), group, async_op=False)
    return out.movedim(0, SEQ_DIM)


def _start_reduce_scatter_seq_first(full: torch.Tensor, group, async_op: bool):
    """Reduce-scatter a contiguous (T, B, …) tensor of partial sums into this rank's (T/t, B, …), summed;
    with `async_op` the result is valid only after the returned work handle's `wait()`."""
    t = group.size()
    if full.shape[0] % t:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by tp={t}")
    out = full.new_empty((full.shape[0] // t, *full.shape[1:]))  # (T/t, B, …)
    work = getattr(dist, REDUCE_SCATTER)(out, full, group=group, async_op=async_op)
    return out, work


class _CopyToTensorRegion(torch.autograd.Function):
    """`f`: forward identity, backward all-reduce (the input fans out to every rank's shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """`g`: forward all-reduce (sum the partial products), backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """SP's `f`: forward all-gather along the sequence, backward reduce-scatter (sum, keep own tokens)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _GatherForReplicated(_GatherFromSequenceRegion):
    """The sequence-split stream gathered for modules every tp rank computes alike (BERT's heads): forward
    all-gather along the sequence (as SP's `f`); backward keeps this rank's chunk of the gradient, which is
    already whole and equal on every rank (what follows is replicated), so nothing is summed."""

    @staticmethod
    def backward(ctx, grad):
        t, rank = ctx.group.size(), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=SEQ_DIM)[rank].contiguous(), None


class SequenceGather(nn.Module):
    """Under sequence parallelism: (B, T/t, h) → the whole (B, T, h) for replicated modules after it."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherForReplicated.apply(x, self.group)


class CopyToTensorRegion(nn.Module):
    """Megatron's `f` as a module: identity forward, gradient summed over tp backward, for a replicated
    activation that each rank then uses for its own heads only (MLA's shared rope key)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyToTensorRegion.apply(x, self.group)


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """SP's `g`: forward reduce-scatter along the sequence, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherSeqLinear(torch.autograd.Function):
    """SP's all-gather fused with a column-parallel linear; only the sequence shard is kept for backward.

    Rank r holds X_r (B, T/t, in), its tokens, and A_i (in, out/t), its output columns (stored transposed,
    as `F.linear`'s (out/t, in) weight), with bias b_i:

        forward    Y   = AG(X_r)·A_i + b_i        (B, T, out/t)
        backward   dX_r = RS(dY·A_iᵀ)              (B, T/t, in): every rank's partial dX, summed, own tokens
                   dA_i = AG(X_r)ᵀ·dY              (in, out/t), AG(X_r) gathered again
                   db_i = Σ_tokens dY

    The composition `gather_from_sequence_region` then `F.linear` computes the same, but autograd saves the
    gathered AG(X_r): s·b·in per rank. Here forward saves X_r and the weight only (s·b·in/t: Korthikanti et
    al.'s `34/t`), and backward re-gathers X_r for dA_i, one more all-gather per linear. Backward overlaps
    its communication with compute through async work handles, in Megatron's order: start the re-gather,
    compute dY·A_iᵀ, wait; start the reduce-scatter of dX, compute dA_i and db_i, wait.

    Autocast: the shard is cast to the autocast dtype *before* the gather (the matmul reads nothing else), so
    the saved shard and both all-gathers are in that dtype; dX is reduce-scattered in the input's dtype, as
    the composition did (it cast the gradient back before its reduce-scatter). Backward casts explicitly
    (it does not run under autocast): dX to the input's dtype, dA_i and db_i to the parameters'.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) and x.is_floating_point() \
            else x.dtype
        ctx.group, ctx.in_dtype = group, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        x_c = x.to(dtype)  # x itself without autocast
        ctx.save_for_backward(x_c, weight)  # the shard (B, T/t, in), not the gathered input
        full, _ = _start_gather_seq_first(x_c, group, async_op=False)  # (T, B, in)
        return F.linear(full.movedim(0, SEQ_DIM), weight, bias)  # autocast (if on) casts weight, bias

    @staticmethod
    def backward(ctx, grad):
        x_c, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        group, dtype = ctx.group, x_c.dtype
        grad_tb = grad.movedim(SEQ_DIM, 0).to(dtype).contiguous()  # (T, B, out/t): the gathered layout
        if need_w:  # 1. start re-gathering the shard for dA_i …
            full, gather = _start_gather_seq_first(x_c, group, async_op=True)  # (T, B, in)
        dx = scatter = None
        if need_x:  # 2. … while computing every rank's partial dX = dY·A_iᵀ
            dx_full = grad_tb.matmul(weight.to(dtype)).to(ctx.in_dtype)  # (T, B, in)
            dx, scatter = _start_reduce_scatter_seq_first(dx_full, group, async_op=True)  # 3. sum, own tokens …
        dw = db = None
        if need_w:  # 4. … while computing dA_i = AG(X_r)ᵀ·dY (as F.linear's (out/t, in) weight gradient)
            gather.wait()
            out_f = grad_tb.shape[-1]
            dw = grad_tb.reshape(-1, out_f).t().matmul(full.reshape(-1, full.shape[-1])).to(weight.dtype)
        if need_b:
            db = grad_tb.reshape(-1, grad_tb.shape[-1]).sum(0).to(ctx.bias_dtype)
        if scatter is not None:
            scatter.wait()
            dx = dx.movedim(0, SEQ_DIM)  # (B, T/t, in)
        return dx, dw, db, None


def linear_with_sequence_gather(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                group) -> torch.Tensor:
    """F.linear(AG(x), weight, bias), x all-gathered along the sequence, saving only x's shard for
    backward (`_GatherSeqLinear`): (B, T/t, in) → (B, T, out/t)."""
    return _GatherSeqLinear.apply(x, weight, bias, group)


def copy_to_tensor_region(x, group):
    return _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x, group):
    return _ReduceFromTensorRegion.apply(x, group)


def gather_from_sequence_region(x, group):
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x, group):
    return _ReduceScatterToSequenceRegion.apply(x, group)


# ---- which rows each rank holds --------------------------------------------------------------------------
def block_rows(sizes: list[int], t: int) -> list[torch.Tensor]:
    """For a weight stacked from blocks of `sizes` rows ([W_q; W_k; W_v], [W_gate; W_up]): per rank, the
    indices of its 1/t slice of every block, in block order."""
    out = []
    for r in range(t):
        idx, start = [], 0
        for n in sizes:
            idx.append(torch.arange(start + r * n // t, start + (r + 1) * n // t))
            start += n
        out.append(torch.cat(idx))
    return out


def qkv_rows(n_heads: int, n_kv_heads: int, head_dim: int, t: int) -> list[torch.Tensor]:
    """Rows of [W_q; W_k; W_v] per rank. Query heads split evenly; KV heads split evenly when t divides
    n_kv_heads, else (t a multiple of n_kv_heads) each rank takes the one KV head its query heads use, so
    t / n_kv_heads ranks hold a copy of it."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    kv_per_rank = max(1, n_kv_heads // t)
    out = []
    for r in range(t):
        first_kv = r * n_kv_heads // t
        kv_idx = torch.arange(first_kv * head_dim, (first_kv + kv_per_rank) * head_dim)
        q_idx = torch.arange(r * q // t, (r + 1) * q // t)
        out.append(torch.cat([q_idx, q + kv_idx, q + kv + kv_idx]))
    return out


def padded_vocab(vocab_size: int, t: int) -> int:
    """Vocabulary rounded up to a multiple of t (Megatron pads further for GEMM shapes; not needed here)."""
    return -(-vocab_size // t) * t


# ---- layers ----------------------------------------------------------------------------------------------
def group_size_rank(group, t: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """(tp size, this rank's index) of `group`, or as given (a layout planned without processes: group None)."""
    if t is None:
        t = group.size()
    if rank is None:
        rank = dist.get_rank(group)
    return t, rank


class Sharded(nn.Module):
    """Shared by the parallel layers: the group, tp size and rank, and how to put the full weight back."""

    group: dist.ProcessGroup | None
    tp_size: int = 1
    tp_index: int = 0
    sharded_names: tuple[str, ...] = ("weight",)  # parameters split over tp (the others are replicated)

    @property
    def tp(self) -> int:
        return self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.tp_index

    def shard_index(self, name: str) -> tuple[torch.Tensor | None, slice | None]:
        """Which (rows, columns) of the full parameter `name` this rank holds (None: all); rows past the
        full tensor are padding."""
        return None, None

    def norm_row_mask(self) -> torch.Tensor | None:
        """Rows of the weight this rank counts in the gradient norm (None: all; see `grad_norm`)."""
        return None


class ColumnParallelLinear(Sharded):
    """Y_i = X A_i (+ b_i): this rank's output rows `rows[rank]` of the full (out, in) weight.

    Input: replicated (B, T, in) through `f`, or with `sequence_parallel` (B, T/t, in) gathered along
    the sequence (`_GatherSeqLinear`: only the shard is saved, backward gathers it again). Output:
    (B, T, out_i), split over the output features (never gathered here).
    """

    sharded_names = ("weight", "bias")

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, rows: list[torch.Tensor],
                 full_out: int, group, sequence_parallel: bool = False, rank: int | None = None):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.tp_size, self.tp_index = group_size_rank(group, len(rows), rank)
        self.rows, self.full_out, self.sequence_parallel = rows, full_out, sequence_parallel
        self.shared_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None  # see share_rows

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, rows: list[torch.Tensor], sequence_parallel: bool = False,
                   weight: nn.Parameter | None = None, rank: int | None = None) -> ColumnParallelLinear:
        """Slice `linear` (padded to the largest row index + 1 with zero rows); `weight` reuses a shard
        already made (tied embeddings). On the meta device only the shard's shape is made."""
        _, rank = group_size_rank(group, len(rows), rank)
        full, mine = linear.weight.detach(), rows[rank]
        if weight is None:
            weight = nn.Parameter(_take_rows(full, mine))
        bias = nn.Parameter(_take_rows(linear.bias.detach(), mine)) if linear.bias is not None else None
        return cls(weight, bias, rows, full.shape[0], group, sequence_parallel, rank)

    def shard_index(self, name: str) -> tuple[torch.Tensor | None, slice | None]:
        return self.rows[self.tp_index], None

    def share_rows(self, local: torch.Tensor, compact: torch.Tensor, n_compact: int, owner: bool) -> None:
        """Declare local rows `local` as copies held by several ranks (GQA KV heads when tp > n_kv_heads):
        `compact` are their indices in a space of `n_compact` rows common to all ranks; `owner` marks the
        one rank that counts them in the gradient norm."""
        self.shared_rows = (local, compact, n_compact)
        self._owner = owner

    def norm_row_mask(self) -> torch.Tensor | None:
        if self.shared_rows is None or self._owner:
            return None
        mask = torch.ones(self.weight.shape[0], dtype=torch.bool, device=self.weight.device)
        mask[self.shared_rows[0]] = False
        return mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # (B, T/t, in) all-gathered → (B, T, out/t); backward re-gathers the shard
            return linear_with_sequence_gather(x, self.weight, self.bias, self.group)
        x = copy_to_tensor_region(x, self.group)
        return F.linear(x, self.weight, self.bias)  # (B, T, out/t)

    def full_weight(self, name: str) -> torch.Tensor:
        local = getattr(self, name)
        parts = _all_gather_stacked(local.detach(), self.group)  # (t, out/t, …)
        full = local.new_zeros((max(int(r.max()) for r in self.rows) + 1, *local.shape[1:]))
        for r, rows in enumerate(self.rows):
            full[rows.to(full.device)] = parts[r]
        return full[:self.full_out]

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1]}, out={self.weight.shape[0]} of {self.full_out}, tp={self.tp}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(Sharded):
    """Y = Σ_i X_i A_i + b: this rank's input columns `cols[rank]`; `g` (or a reduce-scatter along the
    sequence) sums the partial products. The bias is added once, after the sum."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, cols: list[torch.Tensor], group,
                 sequence_parallel: bool = False, rank: int | None = None):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.tp_size, self.tp_index = group_size_rank(group, len(cols), rank)
        self.cols, self.sequence_parallel = cols, sequence_parallel
        if bias is not None and sequence_parallel:
            bias.sequence_parallel = True  # added to this rank's tokens only: grads are partial

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, cols: list[torch.Tensor],
                   sequence_parallel: bool = False, rank: int | None = None) -> RowParallelLinear:
        _, rank = group_size_rank(group, len(cols), rank)
        c = cols[rank]  # contiguous: block_rows of one block
        weight = nn.Parameter(linear.weight.detach()[:, int(c[0]):int(c[-1]) + 1].clone())
        bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        return cls(weight, bias, cols, group, sequence_parallel, rank)

    def shard_index(self, name: str) -> tuple[torch.Tensor | None, slice | None]:
        if name == "bias":
            return None, None
        c = self.cols[self.tp_index]
        return None, slice(int(c[0]), int(c[-1]) + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (B, T, out): this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.group)  # (B, T/t, out)
        else:
            y = reduce_from_tensor_region(y, self.group)
        return y + self.bias if self.bias is not None else y

    def full_weight(self, name: str) -> torch.Tensor:
        if name == "bias":
            return self.bias.detach().clone()
        parts = _all_gather_stacked(self.weight.detach().t(), self.group)  # (t, in/t, out)
        full = self.weight.new_zeros(self.weight.shape[0], sum(len(c) for c in self.cols))
        for r, cols in enumerate(self.cols):
            full[:, cols.to(full.device)] = parts[r].t()
        return full

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]} of {sum(len(c) for c in self.cols)}, out={self.weight.shape[0]}, " \
               f"tp={self.tp}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(Sharded):
    """Rows [i·V/t, (i+1)·V/t) of the (padded) table. Ids outside give zeros; `g` sums the one rank that
    holds each id (with `sequence_parallel`, a reduce-scatter leaves each rank its tokens: (B, T/t, h))."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group, sequence_parallel: bool = False,
                 t: int | None = None, rank: int | None = None):
        super().__init__()
        self.weight, self.vocab_size, self.group = weight, vocab_size, group
        self.tp_size, self.tp_index = group_size_rank(group, t, rank)
        self.sequence_parallel = sequence_parallel
        self.vocab_start = self.tp_rank * weight.shape[0]

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group, sequence_parallel: bool = False, t: int | None = None,
                   rank: int | None = None) -> VocabParallelEmbedding:
        t, rank = group_size_rank(group, t, rank)
        full = emb.weight.detach()
        rows = block_rows([padded_vocab(full.shape[0], t)], t)[rank]
        return cls(nn.Parameter(_take_rows(full, rows)), full.shape[0], group, sequence_parallel, t, rank)

    def shard_index(self, name: str) -> tuple[torch.Tensor | None, slice | None]:
        return self.vocab_rows[self.tp_index], None

    @property
    def vocab_rows(self) -> list[torch.Tensor]:
        return block_rows([self.weight.shape[0] * self.tp], self.tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, h)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(x, self.group)  # (B, T/t, h)
        return reduce_from_tensor_region(x, self.group)

    def full_weight(self, name: str) -> torch.Tensor:
        parts = _all_gather_stacked(self.weight.detach(), self.group)  # (t, V/t, h)
        return parts.reshape(-1, self.weight.shape[1])[:self.vocab_size]

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]} of {self.vocab_size} (padded)"


class SequenceShardedEmbedding(nn.Embedding):
    """A small embedding under sequence parallelism (learned positions, BERT's token types): the full
    (replicated) table, but each rank looks up only its own chunk of the ids along the sequence (the last
    dim: positions (T,), token types (B, T)), matching its (B, T/t, h) slice of the residual stream. Each
    rank's gradient covers only its tokens, so `finish_grads` sums them over tp."""

    def __init__(self, emb: nn.Embedding, group, t: int | None = None, rank: int | None = None):
        super().__init__(emb.num_embeddings, emb.embedding_dim, _weight=emb.weight.detach().clone())
        self.group = group
        self.tp_size, self.tp_index = group_size_rank(group, t, rank)
        self.weight.sequence_parallel = True

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        mine = positions.chunk(self.tp_size, dim=-1)[self.tp_index]  # (T/t,) or (B, T/t)
        return super().forward(mine)


class TPRegionDropout(nn.Dropout):
    """Dropout on a tp-sharded activation: masks drawn from this rank's stream (see `parallel.rng`)."""

    def __init__(self, p: float, rng: TPRNGTracker):
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.rng.tp_rng():
            return super().forward(x)


def _take_rows(full: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """full[rows] with rows ≥ len(full) as zero padding; on the meta device, only the shape."""
    shape = (len(rows), *full.shape[1:])
    if full.device.type == "meta":
        return torch.empty(shape, dtype=full.dtype, device="meta")
    padded = torch.cat([full, full.new_zeros(int(rows.max()) + 1 - full.shape[0], *full.shape[1:])]) \
        if int(rows.max()) >= full.shape[0] else full
    return padded[rows.to(full.device)].clone()


def _all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Plain (no autograd) all-gather of equal shapes → (t, *x.shape)."""
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))  # gathered along dim 0
    getattr(dist, ALL_GATHER)(out, x.contiguous(), group=group)
    return out.view(group.size(), *x.shape)


# ---- vocab-parallel cross-entropy ------------------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ℓ = log Σ_v exp(z_v − m) − (z_y − m) from logits split over the vocabulary.

    Rank i holds columns [s_i, s_i + V/t). Three reductions over tp, none of size V: the max m (for
    stability), then Σ exp(z − m) and the target logit z_y − m (held by exactly one rank, zero elsewhere),
    the latter two packed into one all-reduce. Padding columns (ids ≥ vocab_size) are set to −∞ first, so
    they get zero probability and zero gradient. Backward: ∂ℓ/∂z = softmax(z) − onehot(y), local.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, n_valid):
        # logits: (N, V/t) fp32, targets: (N,) global ids, n_valid: real (non-padding) columns on this rank
        width = logits.shape[-1]
        start = dist.get_rank(group) * width
        if n_valid < width:
            logits = logits.clone()
            logits[:, max(n_valid, 0):] = float("-inf")
        m = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)  # (N,)
        shifted = logits - m.unsqueeze(-1)
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < width)
        local_t = local_t.masked_fill(~mine, 0)
        target = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        target = torch.where(mine, target, torch.zeros_like(target))
        exp = shifted.exp()  # (N, V/t)
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), target]), group)  # (2, N): Σexp, z_y − m
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local_t, mine)  # softmax, in place
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine = ctx.saved_tensors
        dz = softmax.clone()
        rows = torch.arange(dz.shape[0], device=dz.device)
        dz[rows, local_t] -= mine.to(dz.dtype)
        return dz * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_size: int) -> torch.Tensor:
    """Mean token cross-entropy from (B, T, V/t) vocab-split logits and (B, T) targets, in fp32. Targets
    equal to IGNORE_INDEX (-100) add nothing and are not counted, as in `F.cross_entropy` and the fused
    tp = 1 loss."""
    width = logits.shape[-1]
    n_valid = vocab_size - dist.get_rank(group) * width
    targets = targets.reshape(-1)
    acc = torch.promote_types(logits.dtype, torch.float32)  # fp32, or float64 for a float64 model
    losses = _VocabParallelCrossEntropy.apply(logits.to(acc).reshape(-1, width), targets, group, n_valid)
    keep = targets != IGNORE_INDEX  # an ignored target is on no rank: its row's loss is log Σ exp, dropped here
    return (losses * keep).sum() / keep.sum()




def vocab_parallel_correct(logits: torch.Tensor, targets: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """(B, T) bool: the target's logit is the largest of its whole (vocab-split) row, i.e. the greedy
    prediction is right (a tie counts as right). No gradient. Padding columns (ids ≥ vocab_size) are left
    out, as in `vocab_parallel_cross_entropy`."""
    width = logits.shape[-1]
    start = dist.get_rank(group) * width
    n_valid = vocab_size - start
    with torch.no_grad():
        z = logits.detach()
        if n_valid < width:
            z = z.clone()
            z[..., max(n_valid, 0):] = float("-inf")
        best = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < width)
        picked = z.gather(-1, local_t.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        target = _all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), group)
        return target >= best
