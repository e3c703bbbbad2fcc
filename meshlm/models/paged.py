"""Paged attention for serving: keys and values in fixed-size blocks of one pool, read through block tables.

One forward of the serving engine runs a flat list of N tokens from many sequences (`Batch`): some sequences
give one token (decoding), others a run of tokens (a prefill chunk, or a token and its speculative drafts). The
model sees them as N rows of one token each, with per-row positions, so every linear layer is one GEMM over all
the tokens of the step. In attention each layer's `PagedCache.update_and_attend` (the one cache interface,
`models/cache.py`):
- writes each token's key and value into its slot (block × block_size + offset) of the pool (meshlm's slot
  writer on a CPU, `native.write`; `index_copy_` elsewhere);
- decoding rows (one token each) of a plain layer read the pool in place: meshlm's kernel reads each row's keys
  and values through its block table where they lie (`models/native.py`, `kernels/paged_decode.cpp`). Where
  every layer does, rows that share a cached prefix read it in place too, each through its own table (the
  runner's `Batch(in_place=True)`); where some layer cannot, they attend as a cascade (below): the prefix by
  matrix products once for all the rows, each row's own blocks in place or gathered;
- for any other group of sequences with the same number of tokens (the rows verifying k drafts; decoding rows
  where the kernel cannot run: no compiler, an fp16 pool, a window, sinks, a latent cache): gathers each row's
  blocks by its block table (padded to the longest) into a reused buffer, then one masked attention call;
- for a longer run (a prefill chunk): gathers its sequence's keys up to its last token, causal attention from
  the run's offset.
A layer with a sliding window or sinks gets the same masks and applies its band in its core (`visible_keys`);
its decoding rows skip the cascade, whose softmax is plain. A layout read by local layers only (`Batch(window=W)`)
starts each row's table at its first block in the window. An MLA layer's pool holds its latent and RoPE key, and
attends in the absorbed form (models/mla.py); local layers mixed with global ones hold a pool of their own
(`PagedKV(local_blocks=...)`), read through their own block tables.
The layout tensors are built once per step (`Batch`) and shared by the layers. Which blocks a sequence holds
is the scheduler's business (`infer/scheduler.py`, `infer/blocks.py`); this module only reads and writes the
slots it is given.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from meshlm.models import native
from meshlm.models.cache import AttentionCache
from meshlm.models.layers import Attention

# 16-bit masked groups of at least this many rows take `masked_attention`, fewer the kernel on fp32 copies: the
# crossing point measured with benchmarks/attention_kernels.py (SmolLM2's heads, bf16: 1-4 rows favour the
# kernel in fp32, 16 and more `masked_attention`, by 1.6× and more)
MASKED_ROWS = 8


def _kernel_takes_bf16() -> bool:
    """Whether PyTorch's CPU attention kernel is the fastest path for bf16 decoding rows as they are: on a CPU
    with AMX it is, at every shape measured (SmolLM2's heads, 1-64 rows: 1.4-2.1× faster than
    `masked_attention`, 2-10× faster than the kernel on fp32 copies; RESULTS.md "bf16 decoding rows on AMX"), while
    on a CPU with AVX512-BF16 alone (the EPYC) it is 5-15× slower than in fp32."""
    from meshlm.core.precision import cpu_bf16_support

    return cpu_bf16_support() == "AMX-BF16"


# bf16 decoding rows of a plain core call the kernel on bf16 as they are (a CPU with AMX), instead of the
# `MASKED_ROWS` rule below
KERNEL_TAKES_BF16 = _kernel_takes_bf16()


class PagedKV:
    """The pool's tensors: per layer, keys and values of shape (n_kv_heads, num_blocks × block_size, head_dim).
    Head-major, so that a gather of whole blocks lands as (heads, rows, positions, head_dim), whose every
    (row, head) is contiguous: the layout the attention kernel reads fastest. A latent-attention layer (MLA, a
    module with `latent_dim`, models/mla.py) holds one tensor (1, num_blocks × block_size, kv_lora_rank +
    qk_rope_head_dim): its normalised latent and RoPE key, whose first kv_lora_rank columns are also the values
    (the absorbed form), and no separate values (None). With `local_blocks` > 0 the local (sliding-window)
    layers hold `local_blocks` blocks of their own, read through their own block tables (a second `Batch`):
    the engine's second KV cache group (infer/scheduler.py). `bytes_per_token()` is `core/kv_cache.py`'s
    formula."""

    def __init__(self, model, num_blocks: int, block_size: int, local_blocks: int = 0):
        p = next(model.parameters())
        self.num_blocks, self.block_size, self.local_blocks = num_blocks, block_size, local_blocks
        # per layer: (keys, values or None, value width, whether it reads the local tables)
        self.layers: list[tuple[torch.Tensor, torch.Tensor | None, int, bool]] = []
        for layer in model.layers:
            local = bool(local_blocks and getattr(layer.attn, "window", 0))
            slots = (local_blocks if local else num_blocks) * block_size
            latent = getattr(layer.attn, "latent_dim", 0)
            if latent:
                keys = torch.zeros((1, slots, latent), dtype=p.dtype, device=p.device)
                self.layers.append((keys, None, layer.attn.kv_rank, local))
                continue
            shape = (layer.attn.n_kv_heads, slots, layer.attn.head_dim)  # head-major
            self.layers.append((torch.zeros(shape, dtype=p.dtype, device=p.device),
                                torch.zeros(shape, dtype=p.dtype, device=p.device), layer.attn.head_dim, local))
        self.scratch = torch.empty(0, dtype=p.dtype, device=p.device)
        # whether a compiled one-token step may attend inside its graph (`RowCache`): every layer keeps a key and a
        # value per KV head in the one pool (no latent layer, no local pool) and attends with a plain core (no
        # window, no sinks)
        self.rows_in_graph = not local_blocks and all(
            v is not None and not _banded(layer.attn.core) for (_, v, _, _), layer in zip(self.layers, model.layers))
        # each layer's softmax scale, and whether the one-token graph's rows read the pool in place too (the
        # kernel of `models/native.py` takes every layer's pool), through the operator `row_decode`
        self.scales = [_scale(layer.attn.core, width) for (_, _, width, _), layer in zip(self.layers, model.layers)]
        self.rows_in_place = self.rows_in_graph and all(
            native.takes_pool(k, layer.attn.n_heads) for (k, _, _, _), layer in zip(self.layers, model.layers))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for k, v, _, _ in self.layers for t in (k, v) if t is not None)

    def bytes_per_token(self) -> int:
        """Bytes one position of every layer takes in the pool (each layer's bytes / its positions, summed)."""
        return sum(t.numel() * t.element_size() // t.shape[1] for k, v, _, _ in self.layers for t in (k, v)
                   if t is not None)

    def gather_buffer(self, numel: int) -> torch.Tensor:
        """A reused (2, numel) buffer for the keys and values a layer gathers: the layers run one after the other,
        and a fresh tensor of that size a layer would cost page faults on every step, many times the copy."""
        if self.scratch.numel() < 2 * numel:
            self.scratch = torch.empty(2 * numel + 2 * numel // 4, dtype=self.scratch.dtype,
                                       device=self.scratch.device)
        return self.scratch[:2 * numel].view(2, numel)

    def caches(self, batch: Batch, local: Batch | None = None) -> list[PagedCache]:
        """One cache view per layer for the forward of `batch` (`local`: the same tokens in the local layers' own
        block tables, when they have a pool of their own)."""
        return [PagedCache(k, v, local if is_local else batch, self, width) for k, v, width, is_local in self.layers]

    def row_caches(self, batch: Batch) -> list[RowCache]:
        """One `RowCache` per layer for a step of one token (`batch`: one row, one group): its slot, and the slots
        of every position it sees (0 to its own) in order."""
        g = batch.groups[0]
        bs = self.block_size
        if self.rows_in_place:  # its block table (2 entries at least: a graph's sizes are dynamic from 2) and length
            table = g.blocks if g.blocks.shape[1] > 1 else torch.nn.functional.pad(g.blocks, (0, 1))
            lens = torch.tensor([g.keys], dtype=torch.long, device=g.blocks.device)
            return [RowCache(k, v, batch.slots, None, (table, lens, bs, scale))
                    for (k, v, _, _), scale in zip(self.layers, self.scales)]
        index = (g.blocks[0, :, None] * bs + torch.arange(bs, device=g.blocks.device)).reshape(-1)[:g.keys]
        return [RowCache(k, v, batch.slots, index) for k, v, _, _ in self.layers]

    def opaque_caches(self) -> list[OpaqueCache]:
        """One `OpaqueCache` per layer: what a compiled step hands its layers (built once, for every step)."""
        return [OpaqueCache(i, width, v is None) for i, (_, v, width, _) in enumerate(self.layers)]


@dataclass
class Group:
    """`rows` sequences of `T` tokens each, tokens `start`..`start + rows × T - 1` of the step (row by row): row
    r's keys are in `blocks[r]` (in order), and its token t may see key j when `mask[r, 0, t, j]`; `causal`: one
    row from position 0, whose mask is plain causal attention. `shared`: blocks that every row of a group of
    decoding rows starts with (a common prompt prefix, shared by prefix caching); then `blocks` and `mask` are
    each row's own blocks after them, and attention runs as a cascade (`PagedCache.cascade`)."""

    start: int
    rows: int
    T: int
    blocks: torch.Tensor
    mask: torch.Tensor | None
    keys: int
    causal: bool = False
    shared: torch.Tensor | None = None  # decoding rows' common first blocks (cascade attention), else None
    shared_keys: int = 0
    # decoding rows (T = 1, no window): the positions each row sees (its first lens[r]), and in a cascade the
    # positions of each row's own blocks (`blocks`): what attention read in place takes (`models/native.py`)
    lens: torch.Tensor | None = None
    own_lens: torch.Tensor | None = None
    # the gather indices of `blocks` and of `shared`, by pool shape: built by the first layer, read by the rest
    index: dict = field(default_factory=dict, repr=False)
    shared_index: dict = field(default_factory=dict, repr=False)


class Batch:
    """The layout of one step's tokens: per sequence (in token order) its positions and block table; each
    position's slot is block × block_size + offset. Consecutive sequences with the same number of tokens, up
    to `group_max` (decoding rows: one; a token and its speculative drafts: a few), and of lengths not far apart
    (the scheduler sorts them by length), attend in one call; a longer run (a prefill chunk) attends alone.
    Built from plain sequences (positions: a list or a range; block tables: lists or tuples), what a
    tensor-parallel leader broadcasts. `window` W > 0: every layer reading this layout is local (sliding window
    W), so a row reads its blocks from the first one holding position first − W + 1 on (the scheduler may have
    freed the ones before: `infer/scheduler.py`), and attention costs the window, not the whole sequence.
    `in_place`: every layer reads decoding rows in place (what the runner asks for where `PagedKV.rows_in_place`),
    so rows that share first blocks still read them each through its own table (no cascade), and, each read to its
    own length with nothing padded, lengths far apart do not split them (one kernel call a layer)."""

    def __init__(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], block_size: int, device,
                 group_max: int = 16, window: int = 0, in_place: bool = False):
        self.block_size, self.window, self.cascade = block_size, window, not in_place
        positions, slots = [], []
        for pos, blocks in rows:
            positions.extend(pos)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.groups: list[Group] = []
        i = start = 0
        while i < len(rows):
            T = len(rows[i][0])
            j = i + 1
            while T <= group_max and j < len(rows) and len(rows[j][0]) == T and not (
                    (T > 1 or not in_place) and self._longer(rows[i], rows[j])):
                j += 1
            self.groups.append(self._group(rows[i:j], start, T, device))
            start += (j - i) * T
            i = j

    def _longer(self, first, row) -> bool:
        """Whether `row` is long enough against the group's `first` (rows come shortest first) to start a
        group of its own: every row of a group is padded to its longest, so lengths far apart waste copies."""
        return row[0][-1] > 1.25 * first[0][-1] + 2 * self.block_size

    def _common(self, rows) -> int:
        """How many first blocks every row holds alike (each row keeps at least its last position's block)."""
        first = rows[0][1]
        limit = min((pos[-1]) // self.block_size for pos, _ in rows)
        n = 0
        while n < limit and all(len(b) > n and b[n] == first[n] for _, b in rows):
            n += 1
        return n

    def _group(self, rows, start: int, T: int, device) -> Group:
        bs = self.block_size
        ends = [pos[-1] + 1 for pos, _ in rows]
        if self.window and any(pos[0] >= self.window + bs - 1 for pos, _ in rows):
            return self._windowed(rows, start, T, device)
        width = -(-max(ends) // bs)
        table = [list(blocks[:width]) + [0] * (width - len(blocks[:width])) for _, blocks in rows]
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        if len(rows) == 1 and rows[0][0][0] == 0:  # a prompt's first chunk: causal, no mask
            return Group(start, 1, T, blocks, None, ends[0], causal=True)
        seen = torch.tensor(ends, dtype=torch.long, device=device) if T == 1 else None
        if len(rows) == 1 and T == 1:  # one decoding row: it sees every key up to its own, no mask
            return Group(start, 1, 1, blocks, None, ends[0], lens=seen)
        common = self._common(rows) if self.cascade and T == 1 and len(rows) > 1 else 0
        if common:  # cascade: the shared blocks once for every row, then each row's own
            own = [(pos, b[common:]) for pos, b in rows]
            shift = common * bs
            width = -(-max(ends) // bs) - common
            table = [list(b[:width]) + [0] * (width - len(b[:width])) for _, b in own]
            mask = (torch.arange(width * bs, device=device)[None, :] < (seen - shift)[:, None])[:, None, None, :]
            return Group(start, len(rows), 1, torch.tensor(table, dtype=torch.long, device=device), mask, width * bs,
                         shared=torch.tensor(rows[0][1][:common], dtype=torch.long, device=device), shared_keys=shift,
                         lens=seen, own_lens=seen - shift)
        first = torch.tensor([pos[0] for pos, _ in rows], dtype=torch.long, device=device)
        query = first[:, None] + torch.arange(T, device=device)  # (R, T) positions
        keys = torch.arange(width * bs, device=device)
        mask = (keys[None, None, :] <= query[:, :, None])[:, None]  # (R, 1, T, width × bs)
        return Group(start, len(rows), T, blocks, mask, width * bs, lens=seen)

    def _windowed(self, rows, start: int, T: int, device) -> Group:
        """A group of rows past their window: row r's table from its block `skip_r` = ⌊(first − W + 1) / bs⌋ on
        (no query of the step sees a position before it), its mask over the positions those blocks hold
        (skip_r · bs + j), still causal in key index as `visible_keys` needs for the band."""
        bs = self.block_size
        skip = [max(0, pos[0] - self.window + 1) // bs for pos, _ in rows]
        width = max(-(-(pos[-1] + 1) // bs) - s for (pos, _), s in zip(rows, skip))
        table = [list(b[s:s + width]) + [0] * (width - len(b[s:s + width])) for (_, b), s in zip(rows, skip)]
        first = torch.tensor([pos[0] for pos, _ in rows], dtype=torch.long, device=device)
        query = first[:, None] + torch.arange(T, device=device)  # (R, T) positions
        keys = torch.tensor(skip, dtype=torch.long, device=device)[:, None] * bs + torch.arange(width * bs, device=device)
        mask = (keys[:, None, :] <= query[:, :, None])[:, None]  # (R, 1, T, width × bs)
        return Group(start, len(rows), T, torch.tensor(table, dtype=torch.long, device=device), mask, width * bs)

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])


class PagedCache(AttentionCache):
    """One layer's view of the pool for one step: the `AttentionCache` Attention hands its queries, keys and
    values to (models/cache.py). `v` None: a latent layer's (PagedKV), whose values are the first `value_dim`
    columns of its keys; `latent` tells MLA to hand it the absorbed form (models/mla.py)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor | None, batch: Batch, pool: PagedKV, value_dim: int = 0):
        self.k, self.v, self.batch, self.pool = k, v, batch, pool
        self.value_dim = value_dim or k.shape[-1]

    @property
    def latent(self) -> bool:
        return self.v is None

    def gather(self, blocks: torch.Tensor, length: int, memo: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `blocks` (B, nb) (in order) as (B, nkv, length, hd) views of the gather
        buffer: whole blocks of each head copied (`index_select` into a reused buffer). A latent layer copies
        its keys only: its values are their first `value_dim` columns. `memo`: the group's indices by pool
        shape (every layer of a model usually has the same: the first one builds it)."""
        B, nb = blocks.shape
        nkv, slots, hd = self.k.shape
        bs = self.batch.block_size
        index = memo.get((nkv, slots))
        if index is None:
            heads = torch.arange(nkv, device=blocks.device)[:, None] * (slots // bs)
            index = memo[nkv, slots] = (heads + blocks.reshape(1, -1)).reshape(-1)
        buf = self.pool.gather_buffer(nkv * B * nb * bs * hd)
        out = []
        for i, src in enumerate((self.k,) if self.v is None else (self.k, self.v)):
            dst = buf[i].view(nkv * B * nb, bs * hd)
            torch.index_select(src.view(-1, bs * hd), 0, index, out=dst)
            out.append(dst.view(nkv, B, nb * bs, hd)[:, :, :length].transpose(0, 1))
        if self.v is None:
            out.append(out[0][..., :self.value_dim])
        return out[0], out[1]

    def update_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, start, core,
                          mask: torch.Tensor | None = None) -> torch.Tensor:
        """q (N, nh, 1, hd), k and v (N, nkv, 1, hd) for the step's N tokens → (N, nh, 1, value width). `core(q, k,
        v, causal, mask)` is the layer's attention kernel (scaled dot product, GQA aware). A latent layer's `k` is
        (N, 1, 1, kv_lora_rank + d_r) and `v` None. `start` (the tokens' positions) and `mask` are unused: the
        step's `Batch` holds each token's position, slot and visible keys."""
        b = self.batch
        if native.writes(k, self.k) and (self.v is None or native.writes(v, self.v)):  # meshlm's slot writer
            native.write(k, v, self.k, self.v, b.slots)
        else:
            self.k.index_copy_(1, b.slots, k[:, :, 0].transpose(0, 1).to(self.k.dtype))
            if self.v is not None:
                self.v.index_copy_(1, b.slots, v[:, :, 0].transpose(0, 1).to(self.v.dtype))
        if len(b.groups) == 1 and b.groups[0].T == 1:  # decoding rows only: their output is the whole output
            return self.attend(q, b.groups[0], core)
        out = q.new_empty(q.shape[:-1] + (self.value_dim,))
        nh = q.shape[1]
        for g in b.groups:
            n = g.rows * g.T
            qg = q[g.start:g.start + n, :, 0].view(g.rows, g.T, nh, q.shape[3]).transpose(1, 2)  # (R, nh, T, hd)
            out[g.start:g.start + n, :, 0] = self.attend(qg, g, core).transpose(1, 2).reshape(n, nh, self.value_dim)
        return out

    def attend(self, q: torch.Tensor, g: Group, core) -> torch.Tensor:
        """Group `g`'s queries q (R, nh, T, hd) over their keys → (R, nh, T, value width). Decoding rows of a plain
        core read the pool in place where meshlm's kernel runs (`models/native.py`); every other group gathers."""
        if g.lens is not None and self.v is not None and _plain(core) and native.supports(q, self.k):
            if g.shared is not None:  # the shared prefix by matrix products for all rows, each row's own keys in place
                return self.cascade(q, g, _scale(core, q.shape[-1]), in_place=True)
            return native.decode(q, self.k, self.v, g.blocks, g.lens, self.batch.block_size, _scale(core, q.shape[-1]))
        if g.shared is not None and not _banded(core):
            return self.cascade(q, g, _scale(core, q.shape[-1]))
        if g.shared is not None:  # a sliding window or sinks: the core sees the shared keys with the rest
            g = _uncascaded(g)
        keys, values = self.gather(g.blocks, g.keys, g.index)  # (R, nkv, L, hd)
        if not g.causal and q.dtype.itemsize < 4 and q.device.type == "cpu":  # not the 16-bit CPU kernel
            return self.attend_16bit(q, keys, values, g, core)
        return core(q, keys.to(q.dtype), values.to(q.dtype), g.causal, g.mask)

    def attend_16bit(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: Group, core) -> torch.Tensor:
        """Non-causal rows of a 16-bit model on a CPU (decoding rows, a token and its drafts; a GPU keeps its fused
        kernel): PyTorch's CPU attention kernel is 3-16× slower in bf16 than in fp32 at these shapes
        (benchmarks/attention_kernels.py), so at least `MASKED_ROWS` rows of a plain core (always masked) take
        `masked_attention` (16-bit products, fp32 softmax), fewer rows (a single decoding row: no mask) or a
        window or sinks the layer's own core on fp32 copies, the result cast back. On a CPU with AMX
        (`KERNEL_TAKES_BF16`) a plain core's bf16 rows call it as they are: there its bf16 path is the fastest."""
        if KERNEL_TAKES_BF16 and q.dtype == torch.bfloat16 and not _banded(core):
            return core(q, keys.to(q.dtype), values.to(q.dtype), g.causal, g.mask)
        if g.rows >= MASKED_ROWS and not _banded(core):
            return masked_attention(q, keys.to(q.dtype), values.to(q.dtype), g.mask, _scale(core, q.shape[-1]))
        return core(q.float(), keys.float(), values.float(), g.causal, g.mask).to(q.dtype)

    def cascade(self, q: torch.Tensor, g: Group, scale: float, in_place: bool = False) -> torch.Tensor:
        """Decoding rows q (R, nh, 1, hd) over their shared first blocks and then their own: softmax attention
        (scores times `scale`) split in two parts by keys and merged by their log-sum-exps. The shared keys are
        read once for all the rows (one matrix product), not copied once per row; each row's own keys are
        gathered, or with `in_place` read where they lie by meshlm's kernel (`models/native.py`), which returns
        its part normalized with its log-sum-exp."""
        R, nh, _, hd = q.shape
        nkv = self.k.shape[0]
        qh = q[:, :, 0].reshape(R, nkv, nh // nkv, hd)  # a KV head's query heads together (GQA)
        keys, values = self.gather(g.shared[None], g.shared_keys, g.shared_index)  # (1, nkv, P, hd)
        qp = qh.transpose(0, 1).reshape(nkv, -1, hd)  # (nkv, R × group, hd)
        sp = torch.matmul(qp, keys[0].to(q.dtype).transpose(1, 2)) * scale
        mp = sp.amax(-1, keepdim=True)
        ep = (sp - mp).exp()
        shared = (mp, ep.sum(-1, keepdim=True), torch.matmul(ep, values[0].to(q.dtype)))  # before the next gather
        parts = [tuple(t.view(nkv, R, -1, t.shape[-1]).transpose(0, 1) for t in shared)]  # (R, nkv, group, ·)
        if in_place:
            own, lse = native.decode(q, self.k, self.v, g.blocks, g.own_lens, self.batch.block_size, scale, lse=True)
            m1, l1, o1 = (t.float() for t in parts[0])
            lse = lse.view(R, nkv, nh // nkv, 1)
            m = torch.maximum(m1, lse)
            a, b = (m1 - m).exp(), (lse - m).exp()
            out = (o1 * a + own.view(R, nkv, nh // nkv, hd).float() * b) / (l1 * a + b)
            return out.to(q.dtype).reshape(R, nh, 1, self.value_dim)
        keys, values = self.gather(g.blocks, g.keys, g.index)  # (R, nkv, S, hd): the buffer is free again
        ss = (torch.matmul(qh, keys.to(q.dtype).transpose(-1, -2)) * scale).masked_fill(~g.mask, float("-inf"))
        ms = ss.amax(-1, keepdim=True)
        es = (ss - ms).exp()
        parts.append((ms, es.sum(-1, keepdim=True), torch.matmul(es, values.to(q.dtype))))
        (m1, l1, o1), (m2, l2, o2) = parts
        m = torch.maximum(m1, m2)
        a, b = (m1 - m).exp(), (m2 - m).exp()
        return ((o1 * a + o2 * b) / (l1 * a + l2 * b)).reshape(R, nh, 1, self.value_dim)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v for q (R, nh, T, d), k (R, nkv, L, d), v (R, nkv, L, dv), mask (R, 1, T, L)
    (True: attend) → (R, nh, T, dv): a KV head's query heads and queries as the rows of one matrix product (GQA
    without repeating keys), the softmax in fp32 (or wider). The path of 16-bit decoding rows (`attend_16bit`)."""
    R, nh, T, d = q.shape
    nkv, L = k.shape[1], k.shape[2]
    group = nh // nkv
    wide = torch.promote_types(q.dtype, torch.float32)  # the softmax's dtype: fp32 at least
    scores = torch.matmul(q.reshape(R, nkv, group * T, d), k.transpose(-1, -2)).to(wide) * scale
    probs = scores.view(R, nkv, group, T, L).masked_fill(~mask.unsqueeze(2), float("-inf")).softmax(-1)
    return torch.matmul(probs.to(v.dtype).view(R, nkv, group * T, L), v).reshape(R, nh, T, v.shape[-1])


# ---- the compiled step's attention ------------------------------------------------------------------------------
class StepCaches(threading.local):
    """The paged caches of the step a compiled runner is running (`infer/runner.py`), and each layer's attention
    module: what `paged_attention` reads. A compiled graph takes tensors, not a step's layout (its groups, block
    tables and masks differ every step), so the runner sets these before it calls its graph."""

    caches: list[PagedCache] | None = None
    owners: list | None = None


STEP = StepCaches()


# The operator is defined on a `torch.library.Library` with one kernel for every backend, not with
# `torch.library.custom_op`: that wrapper's per-call checks (autograd, aliasing) cost 11 µs a call against 4 µs,
# thirty times a step; serving needs no gradient through it, and its result is always a fresh tensor.
LIBRARY = torch.library.Library("meshlm", "FRAGMENT")
LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor? v, int layer, int value_dim) -> Tensor")


def paged_attention(q, k, v, layer, value_dim):
    """Layer `layer`'s `PagedCache.update_and_attend` for the step in `STEP`, as one operator a compiled graph
    calls without looking inside (`OpaqueCache`): it writes the keys and values into the pool (state the graph
    does not hold) and returns the attention output, (N, nh, 1, value_dim). Its core is the layer's own: the
    latent core of an MLA layer's latent pool, else `core`. The result is contiguous, as the fake kernel says: a
    compiled graph checks its strides, and a view (the cascade's, when a KV head has one query head) would fail
    the step."""
    cache, owner = STEP.caches[layer], STEP.owners[layer]
    return cache.update_and_attend(q, k, v, None, owner.latent_core if cache.latent else owner.core).contiguous()


LIBRARY.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("meshlm::paged_attention", lib=LIBRARY)
def _paged_attention_shape(q, k, v, layer, value_dim):
    return q.new_empty(*q.shape[:-1], value_dim)


LIBRARY.define("row_decode(Tensor q, Tensor k, Tensor v, Tensor table, Tensor lens, int block_size, float scale) "
               "-> Tensor")


def row_decode(q, k, v, table, lens, block_size, scale):
    """`native.decode` as an operator of the compiled one-token graph (`RowCache`): the row's queries over the
    pool's keys and values read in place, after the graph has written its own key and value into them."""
    return native.decode(q, k, v, table, lens, block_size, scale)


LIBRARY.impl("row_decode", row_decode, "CompositeExplicitAutograd")


@torch.library.register_fake("meshlm::row_decode", lib=LIBRARY)
def _row_decode_shape(q, k, v, table, lens, block_size, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class OpaqueCache(AttentionCache):
    """Layer `layer`'s cache as a compiled step traces it: `update_and_attend` is the one operator
    `paged_attention`, so the whole step (embedding, every layer, the head) is one graph with each layer's paged
    attention run eagerly inside it. The same objects serve every step (nothing to guard on but their index)."""

    def __init__(self, layer: int, value_dim: int, latent: bool):
        self.layer, self.value_dim, self.latent = layer, value_dim, latent

    def update_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, start, core,
                          mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.meshlm.paged_attention(q, k, v, self.layer, self.value_dim)


class RowCache(AttentionCache):
    """A layer's pool for a compiled step of one token (a single decoding row, or a one-token chunk), with the
    attention inside the graph: the pool's tensors, the token's slot and the slots of the positions it sees are
    graph inputs, so the key and value are written in place (`index_put_` on the input, which Inductor keeps in
    place) and read through the slot index by the kernels Inductor generates, with no Python between the layers.
    The layer's own core attends (plain: `PagedKV.rows_in_graph`), a 16-bit one on fp32 values as `attend_16bit`
    does for one row. Where meshlm's kernel takes the pool (`PagedKV.rows_in_place`), `in_place` holds the row's
    block table, length, block size and scale instead of a slot index, and the operator `row_decode` reads the
    pool in place."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, index: torch.Tensor | None,
                 in_place: tuple | None = None):
        self.k, self.v, self.slot, self.index, self.in_place = k, v, slot, index, in_place

    def update_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, start, core,
                          mask: torch.Tensor | None = None) -> torch.Tensor:
        self.k[:, self.slot] = k[:, :, 0].transpose(0, 1).to(self.k.dtype)  # (nkv, 1, hd) into its slot
        self.v[:, self.slot] = v[:, :, 0].transpose(0, 1).to(self.v.dtype)
        if self.in_place is not None:  # (block table, length, block size, scale): the pool read in place
            return torch.ops.meshlm.row_decode(q, self.k, self.v, *self.in_place)
        keys, values = self.k[:, self.index][None], self.v[:, self.index][None]  # (1, nkv, L, hd)
        if q.dtype.itemsize < 4 and q.device.type == "cpu":
            return core(q.float(), keys.float(), values.float(), False).to(q.dtype)
        return core(q, keys.to(q.dtype), values.to(q.dtype), False)


def _scale(core, head_dim: int) -> float:
    """The softmax scale of `core`: its module's own `scale` where it sets one (MLA's), else 1/√head_dim."""
    owner = getattr(inspect.unwrap(core), "__self__", None)
    scale = getattr(owner, "scale", None)
    return scale if isinstance(scale, float) else head_dim ** -0.5


def _banded(core) -> bool:
    """Whether `core` is an attention core with a sliding window or sinks (models/layers.py `Attention`), which
    the cascade's plain softmax would not apply."""
    owner = getattr(inspect.unwrap(core), "__self__", None)
    return bool(getattr(owner, "window", 0)) or getattr(owner, "sinks", None) is not None


def _plain(core) -> bool:
    """Whether `core` is `Attention.core` of a global layer without sinks: plain softmax attention, which the
    in-place kernel computes (`models/native.py`)."""
    owner = getattr(inspect.unwrap(core), "__self__", None)
    return (getattr(type(owner), "core", None) is Attention.core and not owner.window and owner.sinks is None
            and not (owner.training and owner.dropout))


def _uncascaded(g: Group) -> Group:
    """A cascade group as a plain one: each row's block table the shared blocks then its own, its mask every
    shared key then its own mask (still causal in key index, as `visible_keys` needs for the band)."""
    blocks = torch.cat([g.shared[None].expand(g.rows, -1), g.blocks], dim=1)
    seen = torch.ones(g.rows, 1, 1, g.shared_keys, dtype=torch.bool, device=g.mask.device)
    return Group(g.start, g.rows, g.T, blocks, torch.cat([seen, g.mask], dim=-1), g.shared_keys + g.keys)

