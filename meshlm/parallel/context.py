"""Context parallelism: causal attention over a sequence split across the `cp` ranks of a ring.

The layout (Megatron-Core's causal load balance): a row of T tokens is cut into 2·cp chunks of
c = T / (2·cp); cp rank i holds chunks i and 2·cp − 1 − i, so every rank has the same share of the
causal triangle's work. Everything outside attention is per token, so the rest of the layer runs on the
rank's 2·c tokens unchanged; only attention needs keys and values of the whole row.

`ring_attention(q, k, v, group)` computes softmax(QKᵀ·s)·V (s = 1/√d unless the layer sets its own, as
multi-head latent attention does) for this rank's queries against every rank's keys: the keys and values
(only the KV heads, never repeated to the query heads under grouped-query attention; the values may be of
another width than the keys, as MLA's are) travel around the cp ring with point-to-point sends
(`dist.batch_isend_irecv`); the next block's exchange is posted before the current block is computed, so the
transfer overlaps the compute.
Each block's scores are masked with the global token indices (causal) and, for packed documents, the
tokens' document ids, and merged into the running result with the online-softmax rule (running row max,
running sum of exponentials, rescaled accumulator), in at least fp32; of another rank's block only the
half the causal mask can leave visible is computed (`_block`). Backward (`_RingAttention`) recomputes
each block from the saved log-sum-exp; dQ stays on the rank while dK and dV travel around the ring with
the keys and values they belong to, and one last hop brings each rank its own keys' complete gradients.

`apply_context_parallel(model, dims, spec=)` changes a plain model from outside, as tensor parallelism and
recomputation do: every layer's attention core becomes the ring, and the model's `embed`, `run_layers` and
`head_loss` take whole rows and run this rank's two chunks at their absolute positions (the model's
`positions` argument); `ContextParallelLoss` does the same for the layout's loss on logits.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.models.layers import document_causal_mask
from meshlm.models.loss import IGNORE_INDEX  # targets that carry no loss (as `F.cross_entropy`'s default)


# ---- the layout -------------------------------------------------------------------------------------------
def chunk_bounds(seq_len: int, cp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, end) token ranges of a row of `seq_len` tokens that cp rank `rank` holds."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2·cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    return (rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global token indices (T / cp of them, ascending) of cp rank `rank`'s share of a row."""
    (a, b), (c, d) = chunk_bounds(seq_len, cp, rank)
    return torch.cat([torch.arange(a, b, device=device), torch.arange(c, d, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the sequence), concatenated."""
    (a, b), (c, d) = chunk_bounds(x.shape[dim], cp, rank)
    return torch.cat([x.narrow(dim, a, b - a), x.narrow(dim, c, d - c)], dim=dim)


# ---- one block --------------------------------------------------------------------------------------------
def _allowed(pos_q: torch.Tensor, pos_k: torch.Tensor, seg_q: torch.Tensor | None,
             seg_k: torch.Tensor | None, window: int = 0) -> torch.Tensor:
    """Which keys each query sees, (B or 1, 1, 1, Tq, Tk): key index ≤ query index (global token indices),
    same document: the model's own rule (`document_causal_mask`), with a group axis for the query heads; with a
    sliding `window`, also key index > query index − window (documents are contiguous runs of the row, so the
    band on row indices is each document's band)."""
    mask = document_causal_mask(pos_q, pos_k, seg_q, seg_k).unsqueeze(2)
    if window:
        mask = mask & (pos_k[None, :] > pos_q[:, None] - window)
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """q: (B, nkv, g, Tq, d), k: (B, nkv, Tk, d) → masked scores (B, nkv, g, Tq, Tk), -inf where hidden."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    return s.masked_fill(~allowed, float("-inf"))


def _block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, pos_q: torch.Tensor, pos_k: torch.Tensor,
                  segs: list[torch.Tensor] | None, rank: int, src: int, qs: slice, ks: slice,
                  window: int = 0) -> torch.Tensor:
    """The masked scores of this rank's query rows `qs` against rank `src`'s key columns `ks` (`_block`)."""
    seg_q = None if segs is None else segs[rank][:, qs]
    seg_k = None if segs is None else segs[src][:, ks]
    return _scores(q, k, scale, _allowed(pos_q, pos_k, seg_q, seg_k, window))


# ---- the ring ---------------------------------------------------------------------------------------------
class _Ring:
    """Point-to-point exchange with the ring's neighbours on the cp group: send to rank + 1, receive from
    rank − 1 (global ranks for the ops). Each exchange is posted at once and waited on when needed."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group  # None: a ring of one (no torch.distributed), which sends to itself
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if group is not None:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post: `send` to the next rank, a tensor like it from the previous one. Returns (buffer, works)."""
        if self.size == 1:
            return send, []
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for work in works:
            work.wait()


def _gather_segments(segments: torch.Tensor | None, ring: _Ring) -> list[torch.Tensor] | None:
    """Every cp rank's document ids (B, T / cp) each, indexed by cp rank (small: one int per token)."""
    if segments is None:
        return None
    if ring.size == 1:
        return [segments]
    parts = [torch.empty_like(segments) for _ in range(ring.size)]
    dist.all_gather(parts, segments.contiguous(), group=ring.group)
    return parts


def _block(rank: int, src: int, Tl: int) -> tuple[slice, slice]:
    """The (query rows, key columns) of this rank's block against `src`'s keys that the causal mask can
    leave visible, under the load balance (c = Tl / 2 tokens per chunk): its own keys, all against all
    (masked); an earlier rank's (src < rank), every query against that rank's first chunk only (its second
    lies after both of ours); a later rank's, our second chunk only (our first lies before both of theirs)
    against all its keys. Either off-diagonal half is wholly visible to the causal mask, so half of each
    off-diagonal block is never computed (Megatron-Core's split)."""
    whole, c = slice(None), Tl // 2
    if src == rank:
        return whole, whole
    return (whole, slice(0, c)) if src < rank else (slice(c, None), whole)


class _RingAttention(torch.autograd.Function):
    """Ring attention's forward (online softmax over the ring's blocks) and backward (each block recomputed
    from the saved log-sum-exp; dK/dV travel the ring back to their owner)."""

    @staticmethod
    def forward(ctx, q, k, v, segments, group, seq_len, scale, window=0, sinks=None):
        ring = _Ring(group)
        B, nh, Tl, d = q.shape
        nkv, d_v = k.shape[1], v.shape[-1]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        qg = q.to(acc_dtype).view(B, nkv, nh // nkv, Tl, d)
        segs = _gather_segments(segments, ring)
        pos_q = local_positions(seq_len, ring.size, ring.rank, q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()  # (B, nkv, Tl, d + d_v): one message a hop
        row_max = torch.full((B, nkv, nh // nkv, Tl, 1), float("-inf"), dtype=acc_dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        # laid out as (B, Tl, heads, d_v) in memory: the layer's (B, T, h) output is then a view of `out` (saved
        # for backward), not another copy of it (docs/memory.md counts one)
        acc = torch.zeros((B, Tl, nkv, nh // nkv, d_v), dtype=acc_dtype, device=q.device).permute(0, 2, 3, 1, 4)
        for t in range(ring.size):
            src = (ring.rank - t) % ring.size
            if t < ring.size - 1:  # the next block travels while this one is computed
                nxt, works = ring.exchange(kv, tag=0)
            qs, ks = _block(ring.rank, src, Tl)
            s = _block_scores(qg[..., qs, :], kv[:, :, ks, :d].to(acc_dtype), scale, pos_q[qs],
                              local_positions(seq_len, ring.size, src, q.device)[ks], segs, ring.rank, src, qs, ks,
                              window)
            # Block 0 is the rank's own keys, where every query sees itself: the row max is finite from then on.
            old_max = row_max[..., qs, :]
            new_max = torch.maximum(old_max, s.amax(-1, keepdim=True))
            p = torch.exp(s - new_max)
            rescale = torch.exp(old_max - new_max)
            row_sum[..., qs, :] = row_sum[..., qs, :] * rescale + p.sum(-1, keepdim=True)
            acc[..., qs, :] = acc[..., qs, :] * rescale + torch.einsum("bhgqk,bhkd->bhgqd", p,
                                                                       kv[:, :, ks, d:].to(acc_dtype))
            row_max[..., qs, :] = new_max
            if t < ring.size - 1:
                _Ring.wait(works)
                kv = nxt
        if sinks is not None:  # one more term in each denominator, exp(sink), with no value (gpt-oss)
            sink = sinks.detach().to(acc_dtype).view(1, nkv, nh // nkv, 1, 1)
            top = torch.maximum(row_max, sink)
            acc, row_sum = acc * torch.exp(row_max - top), row_sum * torch.exp(row_max - top) + torch.exp(sink - top)
            row_max = top
        out = acc / row_sum
        lse = row_max + torch.log(row_sum)  # (B, nkv, g, Tl, 1)
        ctx.save_for_backward(q, k, v, out, lse, *(segs or []))
        ctx.group, ctx.seq_len, ctx.scale, ctx.window = group, seq_len, scale, window
        ctx.sink = None if sinks is None else sink
        return out.view(B, nh, Tl, d_v).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *segs = ctx.saved_tensors
        ring, scale, segs = _Ring(ctx.group), ctx.scale, segs or None
        B, nh, Tl, d = q.shape
        nkv, d_v = k.shape[1], v.shape[-1]
        acc_dtype = out.dtype
        qg = q.to(acc_dtype).view(B, nkv, nh // nkv, Tl, d)
        do = grad_out.to(acc_dtype).reshape(B, nkv, nh // nkv, Tl, d_v)
        delta = (do * out).sum(-1, keepdim=True)  # D = rowsum(dO ∘ O)
        pos_q = local_positions(ctx.seq_len, ring.size, ring.rank, q.device)
        dq = torch.zeros_like(qg)
        kv = torch.cat([k, v], dim=-1).contiguous()  # (B, nkv, Tl, d + d_v), as forward
        dkv_in, dkv_works = None, []
        for t in range(ring.size):
            src = (ring.rank - t) % ring.size
            if t < ring.size - 1:
                nxt, works = ring.exchange(kv, tag=0)
            qs, ks = _block(ring.rank, src, Tl)
            kb, vb = kv[:, :, ks, :d].to(acc_dtype), kv[:, :, ks, d:].to(acc_dtype)
            s = _block_scores(qg[..., qs, :], kb, scale, pos_q[qs],
                              local_positions(ctx.seq_len, ring.size, src, q.device)[ks], segs, ring.rank, src, qs, ks,
                              ctx.window)
            p = torch.exp(s - lse[..., qs, :])  # the block's probabilities, 0 where hidden
            dkv = torch.zeros_like(kv, dtype=acc_dtype)  # [dK; dV] of the block's keys, travelling with them
            dkv[:, :, ks, d:] = torch.einsum("bhgqk,bhgqd->bhkd", p, do[..., qs, :])
            ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do[..., qs, :], vb) - delta[..., qs, :]) * scale
            dq[..., qs, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kb)
            dkv[:, :, ks, :d] = torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[..., qs, :])
            if t > 0:  # the gradient of these keys so far, from the ranks they visited before this one
                _Ring.wait(dkv_works)
                dkv = dkv + dkv_in
            dkv_in, dkv_works = ring.exchange(dkv.contiguous(), tag=1)
            if t < ring.size - 1:
                _Ring.wait(works)
                kv = nxt
        _Ring.wait(dkv_works)  # the last hop: this rank's own keys, with every rank's contribution
        dk, dv = dkv_in[..., :d].to(k.dtype), dkv_in[..., d:].to(v.dtype)
        dsink = None
        if ctx.sink is not None:  # d out / d sink = −p_sink · out, so dL/d sink = −Σ p_sink · rowsum(dO ∘ O)
            dsink = -(torch.exp(ctx.sink - lse) * delta).sum(dim=(0, 3, 4)).reshape(nh).to(q.dtype)
        return dq.view(B, nh, Tl, d).to(q.dtype), dk, dv, None, None, None, None, None, dsink


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, *,
                   segments: torch.Tensor | None = None, scale: float | None = None, window: int = 0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries over the whole row.

    q and k: (B, nh, T/cp, d) and (B, nkv, T/cp, d), v: (B, nkv, T/cp, d_v) with nkv dividing nh: this rank's
    two chunks (see `chunk_bounds`), in order; the values may be narrower or wider than the keys (multi-head latent
    attention's d_v against d_n + d_r), keys and values travelling as one (B, nkv, T/cp, d + d_v) block.
    `segments` (B, T/cp), optional: each token's document id; a query then sees only keys of its own document.
    `window` > 0: each query sees only the last `window` keys (itself included); `sinks` (nh,): a logit per head
    added to each softmax's denominator (gpt-oss), with its gradient. `scale`: the logits' factor (None: 1/√d). Returns (B, nh, T/cp, d_v). A group of one rank is plain causal attention.
    """
    cp = dist.get_world_size(group) if group is not None else 1
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} KV heads do not divide {q.shape[1]} query heads")
    if k.shape[:-1] != v.shape[:-1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must match but for the value width, "
                         f"and the keys' width the queries' {q.shape[-1]}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, segments, group if cp > 1 else None, q.shape[2] * cp, scale, window, sinks)


# ---- the model under cp -----------------------------------------------------------------------------------
def _rebalance(loss: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """This rank's mean token loss → the row's: its value is the mean over every counted target of the cp
    group's rows (the same on every cp rank, as a vocab-parallel loss is on every tp rank), its gradient that
    of this rank's share, loss · n · cp / N (n its counted targets, N the group's), so the gradient mean over
    dp × cp is the gradient of the mean over every token of the global batch, even when the chunks count
    different numbers of ignored targets. One all-reduce of two numbers."""
    n = (targets != IGNORE_INDEX).sum().to(loss.dtype)
    loss = torch.where(n > 0, loss, torch.zeros_like(loss))  # (a chunk with no target: nothing to add)
    sums = torch.stack([n, loss.detach() * n])
    dist.all_reduce(sums, group=group)
    share = loss * (n * cp / sums[0].clamp_min(1))
    return share + (sums[1] / sums[0].clamp_min(1) - share).detach()


class ContextParallelLoss:
    """The layout's loss (`loss(output, targets)`) on this cp rank's share: whole-row targets are cut to
    the rank's two chunks, the mean re-weighted by `_rebalance`. Other attributes are the inner loss's."""

    def __init__(self, inner, dims):
        self.inner, self.dims = inner, dims

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cp = self.dims.cp
        if targets.shape[1] == output.shape[1] * cp:  # whole rows: this rank's chunks
            targets = shard_sequence(targets, cp, self.dims.cp_rank)
        return _rebalance(self.inner(output, targets), targets, self.dims.cp_group, cp)

    def __getattr__(self, name):  # only for names not found on this object (part_names, put, take, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _ring_core(original, group: dist.ProcessGroup):
    """An attention core (`core(q, k, v, causal, mask=None)`) that runs the ring over the cp group.

    Its `mask` argument carries this rank's document ids (B, T/cp), integers, instead of a boolean mask (None:
    one document per row): they must reach the core as an argument, so that recomputation, which replays a
    region with the arguments it saved, sees the same ids as the forward did.

    The layer's attributes tune the ring: `window` and `sinks` (Attention), and for multi-head latent attention
    (models/mla.py) its softmax `scale` (1/√(d_n + d_r) · mscale², not 1/√ of the padded width) and the true
    widths `qk_dim` and `v_dim`: MLA hands its core q, k, v zero-padded to one width (what its caches store), the
    ring takes them unpadded, so the padding's zeros never travel, and pads the output back."""

    owner = getattr(inspect.unwrap(original), "__self__", None)  # the layer's Attention: its window and sinks

    @functools.wraps(original)
    def core(q, k, v, causal: bool = True, mask: torch.Tensor | None = None):
        if k.shape[2] != q.shape[2] or (mask is not None and mask.dtype == torch.bool):
            raise ValueError("under parallel.cp only causal self-attention of whole training rows runs as a "
                             "ring (no encoder mask, no KV cache); use parallel.cp=1 for this")
        sinks = getattr(owner, "sinks", None)
        if sinks is not None:  # this rank's heads' entries (tensor parallelism splits the heads)
            sinks = sinks[owner.head_offset:owner.head_offset + q.shape[1]]
        width = q.shape[-1]
        qk_dim, v_dim = getattr(owner, "qk_dim", width), getattr(owner, "v_dim", width)
        if qk_dim != width or v_dim != width:  # MLA's padded widths (zeros change neither q·k nor the output)
            q, k, v = q[..., :qk_dim], k[..., :qk_dim], v[..., :v_dim]
        y = ring_attention(q, k, v, group, segments=mask, scale=getattr(owner, "scale", None),
                           window=getattr(owner, "window", 0), sinks=sinks)
        return F.pad(y, (0, width - v_dim)) if v_dim != width else y

    return core


def _whole_rows_only(caches, start) -> None:
    if caches is not None or not isinstance(start, int) or start != 0:
        raise ValueError("parallel.cp splits whole training rows; decoding with a KV cache runs in one "
                         "process (meshlm generate), not under parallel.cp")


def _cp_methods(model: nn.Module, dims, layers, tokens_per_x: int) -> dict:
    """The model's `embed`, `run_layers` and `head_loss` on whole rows, for this cp rank: the embedding
    looks up its two chunks of the tokens at their absolute positions (or their in-document `positions`);
    the layers get the chunks' positions (RoPE) and document ids (for the ring, `_ring_core`); the fused
    head + loss takes the chunks' targets and returns the row's mean (`_rebalance`). `tokens_per_x`: row
    tokens of this rank per token of the residual stream (tp under sequence parallelism, else 1)."""
    cp, rank = dims.cp, dims.cp_rank
    embed, run_layers, head_loss = model.embed, model.run_layers, model.head_loss

    def shard(t):
        return None if t is None else shard_sequence(t, cp, rank)

    def whole(t, like: torch.Tensor, length: int):
        return t if t is not None else torch.arange(length, device=like.device).expand(like.shape[0], -1)

    @functools.wraps(embed)
    def cp_embed(idx, start=0, *, positions=None, segments=None):
        _whole_rows_only(None, start)
        return embed(shard(idx), positions=shard(whole(positions, idx, idx.shape[1])))

    @functools.wraps(run_layers)
    def cp_run_layers(x, layer_ids=None, caches=None, start=0, rope=None, *, positions=None, segments=None):
        _whole_rows_only(caches, start)
        positions = shard(whole(positions, x, x.shape[1] * tokens_per_x * cp))
        rope = rope if rope is not None else model.rope(model.rope_len)
        documents = shard(segments)
        for i in range(len(layers)) if layer_ids is None else layer_ids:
            x = layers[i](x, rope, positions=positions, mask=documents)  # mask: the ids (`_ring_core`)
        return x

    @functools.wraps(head_loss)
    def cp_head_loss(x, targets):
        local = shard(targets) if targets.shape[1] == x.shape[1] * cp else targets
        return _rebalance(head_loss(x, local), local, dims.cp_group, cp)

    return {"embed": cp_embed, "run_layers": cp_run_layers, "head_loss": cp_head_loss}


def apply_context_parallel(model: nn.Module, dims, *, spec, sequence_parallel: bool = False) -> None:
    """Put the ring in place of every layer's attention core (the methods `spec.selective_recompute`
    names) and make the model's `embed`, `run_layers` and `head_loss` take whole rows and run this rank's
    share (`_cp_methods`; `forward` and the pipeline stages call them). In place; parameters untouched.
    Apply after tensor parallelism (whose attention the ring runs on this rank's heads) and before pipeline
    cutting (its stages call these methods) and recomputation (which must checkpoint the ring core)."""
    if dims.cp == 1:
        return
    layers = getattr(model, spec.pipeline.layers)
    for layer in layers:
        if layer is None:
            continue
        for path in spec.selective_recompute:
            owner_path, _, name = path.rpartition(".")
            owner = layer.get_submodule(owner_path) if owner_path else layer
            setattr(owner, name, _ring_core(getattr(owner, name), dims.cp_group))
    tokens_per_x = dims.tp if sequence_parallel and dims.tp > 1 else 1
    for name, method in _cp_methods(model, dims, layers, tokens_per_x).items():
        setattr(model, name, method)
