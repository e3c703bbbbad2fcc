"""LoRA (Hu et al. 2021): a frozen linear W plus a trained low-rank update, y = W x + (α/r) B A x.

`attach_lora` adds the update to a linear of a (possibly tensor-parallel) model without moving it: the
matrices live in a child module `lora` of the linear, and a forward hook adds B A x to the linear's output.
The linear keeps its name and its parameters (`layers.3.attn.qkv.weight`), so the base model's
checkpoints, pipeline stages and gradient rules see the model they always saw.

A target may be a row block of a fused linear: `q`, `k`, `v` are the query, key and value rows of the
attention's `[W_q; W_k; W_v]`, `gate` and `up` the halves of SwiGLU's `[W_gate; W_up]`; each target has
its own A (r × in) and B (rows × r), and rows no target covers get no update.

Under tensor parallelism (Megatron's split of W, and the matching split of the update):

* column-parallel W (rows split over tp): B is split like W's rows (each rank holds the rows of B for
  its output rows), A is whole on every rank. A x is computed once per rank; its gradient is partial
  (each rank's B sees only its rows), so it goes through `f` (identity forward, all-reduce backward).
  Under sequence parallelism x holds this rank's tokens: A x is all-gathered along the sequence
  (backward: reduce-scatter), and A's gradient then covers this rank's tokens only (summed over tp
  as a `sequence_parallel` parameter).
* row-parallel W (input columns split over tp): A is split like W's columns, B is whole. The partial
  products A_i x_i are summed over tp (`g`: all-reduce; reduce-scatter along the sequence under SP,
  where B then sees this rank's tokens and is summed over tp as a `sequence_parallel` parameter).

Every parameter is built whole from its own seeded generator and sliced, so any layout starts from the
very values one process has (A: Kaiming-uniform as `nn.Linear` draws it, B: zeros, as the paper).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Sharded,
    copy_to_tensor_region,
    gather_from_sequence_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
)


class SharedRowsError(ValueError):
    """A target covers rows several tp ranks hold copies of (GQA with parallel.tp > model.n_kv_heads)."""


@dataclass(frozen=True)
class Block:
    """One LoRA target on a linear: its name and the rows [lo, hi) of the whole weight it updates."""

    name: str
    lo: int
    hi: int


def seeded(seed: int, name: str) -> torch.Generator:
    """A CPU generator for parameter `name`: the same values on every rank and in every layout."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    return g


def kaiming_a(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """`nn.Linear`'s default init of a (rows, cols) weight: U(-1/√cols, 1/√cols) (Kaiming-uniform, a=√5)."""
    bound = 1.0 / math.sqrt(cols)
    return torch.empty(rows, cols).uniform_(-bound, bound, generator=generator)


class LoRA(Sharded):
    """The A and B matrices of the targets on one linear (`lora.A_q`, `lora.B_q`, ...) and their forward.

    `kind` is how the linear is split: "dense" (tp = 1), "column" or "row". `sharded_names` lists the
    parameters split over tp (B under column, A under row): the gradient-norm rules count those rows on
    every rank and the replicated ones once (`parallel/grads.py`)."""

    def __init__(self, linear: nn.Module, blocks: list[Block], rank: int, alpha: float, dropout: float,
                 full_in: int, prefix: str, seed: int, rng=None):
        super().__init__()
        self.blocks, self.r, self.scaling = blocks, rank, alpha / rank
        self.kind = "column" if isinstance(linear, ColumnParallelLinear) else \
            "row" if isinstance(linear, RowParallelLinear) else "dense"
        self.group = getattr(linear, "group", None)
        self.tp_size, self.tp_index = (linear.tp, linear.tp_rank) if self.kind != "dense" else (1, 0)
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False))
        self.full_in, self.prefix = full_in, prefix
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.rng = rng  # the tp dropout stream, for inputs that differ between tp ranks
        device, dtype = linear.weight.device, linear.weight.dtype
        out_rows = linear.rows[self.tp_index] if self.kind == "column" else torch.arange(linear.weight.shape[0])
        self.local: dict[str, tuple[int, int, torch.Tensor]] = {}  # block → (first, end) local output rows, rows of B
        names = []
        for b in blocks:
            inside = ((out_rows >= b.lo) & (out_rows < b.hi)).nonzero().flatten()
            first, end = int(inside[0]), int(inside[-1]) + 1
            if end - first != len(inside):
                raise ValueError(f"LoRA target {b.name} of {prefix}: this rank's rows of it are not contiguous")
            self.local[b.name] = (first, end, out_rows[first:end] - b.lo)
            a_full = kaiming_a(rank, full_in, seeded(seed, f"{prefix}.lora.A_{b.name}"))
            b_full = torch.zeros(b.hi - b.lo, rank)
            self.register_parameter(f"A_{b.name}", nn.Parameter(self.local_slice(f"A_{b.name}", a_full).to(
                device=device, dtype=dtype)))
            self.register_parameter(f"B_{b.name}", nn.Parameter(self.local_slice(f"B_{b.name}", b_full).to(
                device=device, dtype=dtype)))
            names += [f"A_{b.name}", f"B_{b.name}"]
        self.sharded_names = tuple(n for n in names if (n[0] == "B") == (self.kind == "column")) \
            if self.kind != "dense" else ()
        # Parameters that see only this rank's tokens under SP: summed over tp after backward.
        if self.sequence_parallel:
            for n in names:
                if (n[0] == "A") == (self.kind == "column"):
                    getattr(self, n).sequence_parallel = True
        for p in self.parameters():
            p.adapter = True

    # ---- layout: whole tensors ↔ this rank's part ---------------------------------------------------------
    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor `name` (A_x: (r, in), B_x: (rows, r))."""
        if name.startswith("B") and self.kind == "column":
            return full[self.local[name[2:]][2]].clone()
        if name.startswith("A") and self.kind == "row":
            return full[:, self._cols()].clone()
        return full.clone()

    def _cols(self) -> slice:
        width = self.full_in // self.tp_size
        return slice(self.tp_index * width, (self.tp_index + 1) * width)

    def is_sharded(self, name: str) -> bool:
        return name in self.sharded_names

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every tp rank's `local` part of `name` (a collective over tp when sharded)."""
        import torch.distributed as dist

        if not self.is_sharded(name):
            return local.detach().clone()
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=0 if name.startswith("B") else 1)

    # ---- forward ---------------------------------------------------------------------------------------------
    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None:
            return x
        split_input = self.kind == "row" or (self.kind == "column" and self.sequence_parallel)
        if split_input and self.rng is not None:  # each rank holds other elements: its own masks
            with self.rng.tp_rng():
                return self.dropout(x)
        return self.dropout(x)

    def delta(self, x: torch.Tensor, out_features: int) -> torch.Tensor:
        """(α/r) B A x for every target, placed at their output rows (zeros elsewhere)."""
        x = self._drop(x)
        a = torch.cat([getattr(self, f"A_{b.name}") for b in self.blocks])  # (n·r, in or in/t)
        u = F.linear(x, a)
        if self.kind == "column":
            u = gather_from_sequence_region(u, self.group) if self.sequence_parallel else \
                copy_to_tensor_region(u, self.group)
        elif self.kind == "row":
            u = reduce_scatter_to_sequence_region(u, self.group) if self.sequence_parallel else \
                reduce_from_tensor_region(u, self.group)
        parts = u.split(self.r, dim=-1)
        if len(self.blocks) == 1:
            first, end, _ = self.local[self.blocks[0].name]
            if first == 0 and end == out_features:
                return F.linear(parts[0], getattr(self, f"B_{self.blocks[0].name}")) * self.scaling
        pieces, at = [], 0
        for b, ub in sorted(zip(self.blocks, parts), key=lambda z: self.local[z[0].name][0]):
            first, end, _ = self.local[b.name]
            if first > at:
                pieces.append(u.new_zeros(*u.shape[:-1], first - at))
            pieces.append(F.linear(ub, getattr(self, f"B_{b.name}")) * self.scaling)
            at = end
        if at < out_features:
            pieces.append(u.new_zeros(*u.shape[:-1], out_features - at))
        return torch.cat(pieces, dim=-1)

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of W + (α/r) B A (the linear's local weight `weight`); row-parallel A is this
        rank's columns, so every rank merges its own part with no communication."""
        w = weight.clone()
        for b in self.blocks:
            first, end, _ = self.local[b.name]
            update = getattr(self, f"B_{b.name}").float() @ getattr(self, f"A_{b.name}").float()
            w[first:end] += (update * self.scaling).to(w.dtype)
        return w

    def extra_repr(self) -> str:
        return f"targets={[b.name for b in self.blocks]}, r={self.r}, scaling={self.scaling:g}, {self.kind}"


def _hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output + module.lora.delta(args[0], output.shape[-1])


def attach_lora(linear: nn.Module, blocks: list[Block], rank: int, alpha: float, dropout: float, prefix: str,
                seed: int, rng=None) -> LoRA:
    """Add LoRA on `blocks` of `linear` (an `nn.Linear` or a tensor-parallel linear) at path `prefix`."""
    full_in = linear.weight.shape[1] * (linear.tp if isinstance(linear, RowParallelLinear) else 1)
    lora = LoRA(linear, blocks, rank, alpha, dropout, full_in, prefix, seed, rng)
    shared = getattr(linear, "shared_rows", None)
    if shared is not None:  # GQA KV heads held by several tp ranks: their B rows would be copies too
        held = set(shared[0].tolist())
        for b in blocks:
            first, end, _ = lora.local[b.name]
            if held & set(range(first, end)):
                raise SharedRowsError(b.name)
    linear.add_module("lora", lora)
    linear._lora_hook = linear.register_forward_hook(_hook)
    return lora


@torch.no_grad()
def merge_lora(linear: nn.Module) -> None:
    """Fold the update into the linear's weight and drop the adapter (serving: no extra work per token)."""
    linear.weight.copy_(linear.lora.merged_weight(linear.weight))
    linear._lora_hook.remove()
    del linear._lora_hook
    del linear.lora


def detach_lora(linear: nn.Module) -> LoRA | None:
    """Take the unmerged LoRA that `attach_lora` put on `linear` off it (its hook and submodule removed, the
    weight unchanged) and return it, for a caller that runs its update itself (meshlm serve: on some rows of a
    batch); None when `linear` has none."""
    if not hasattr(linear, "_lora_hook"):
        return None
    lora = linear.lora
    linear._lora_hook.remove()
    del linear._lora_hook
    del linear.lora
    return lora
