"""Per-parameter seeded initialisation: any slice of a parameter can be made without the whole tensor.

A model's initial weights are defined by one base seed (drawn once from the global generator, so
`torch.manual_seed(s)` still decides everything) and, per parameter, an `InitRule`: zeros, ones, or
N(0, std²). A normal parameter of full shape (R, C…) is generated in *row blocks* of
`rows_per_block(shape)` rows (about 64K values each); block b of parameter `name` is drawn from a fresh
CPU generator seeded with `block_seed(base, name, b)`. So the values of any rows and columns depend only
on (base seed, name, full shape), never on which process asks or what else it holds:

* a single process fills the whole tensor block after block;
* a tensor-parallel rank fills only its rows (column-parallel, vocab-parallel: the blocks holding them)
  or its columns (row-parallel: every block, keeping its columns), one block in memory at a time;
* rows past the full tensor (vocabulary padding) are zeros.

Hence tp=N starts bit-identical to tp=1 while no rank ever holds a whole parameter, and the model can be
built on the meta device first (`torch.device("meta")`) and materialised shard by shard.
CPU generators make the values the same on every device (they are copied to the GPU after).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

BLOCK_VALUES = 1 << 16  # values per generated block: small enough to be free, big enough to be fast


@dataclass(frozen=True)
class InitRule:
    """How a parameter starts: `kind` is "normal" (N(0, std²)), "zeros" or "ones"."""

    kind: str
    std: float = 0.0


# torch's own default initialisers of nn.Linear / nn.Embedding and their in-place kernels. On a meta tensor
# they compute nothing, but `normal_` goes through torch._refs, whose wrapper imports torch._dynamo and
# triton's library (~140 MiB of resident memory for the rest of the process) the first time it runs.
_RANDOM_INITS = frozenset({torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.trunc_normal_,
                           torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_,
                           torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_,
                           torch.Tensor.normal_, torch.Tensor.uniform_})


class _SkipMetaInit(TorchFunctionMode):
    """Random initialisers applied to meta tensors return the tensor untouched (what they would do anyway,
    minus the compiler stack's import); every other call, and every call on real tensors, runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_INITS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """`torch.device("meta")` for building a model whose weights come later (a checkpoint's, a shard's):
    shapes without storage, and no random initialiser run on them (`_SkipMetaInit`)."""
    with _SkipMetaInit(), torch.device("meta"):
        yield


def draw_base_seed() -> int:
    """One draw from the global generator: the seed every parameter's own seed derives from."""
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64, device="cpu"))  # even under a meta device context


def block_seed(base: int, name: str, block: int) -> int:
    """A stable 63-bit seed for block `block` of parameter `name` (Python's `hash` is salted per process)."""
    digest = hashlib.blake2b(f"{base}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_block(shape: tuple[int, ...]) -> int:
    cols = 1
    for s in shape[1:]:
        cols *= s
    return max(1, BLOCK_VALUES // max(cols, 1))


def _block(base: int, name: str, shape: tuple[int, ...], b: int, std: float) -> torch.Tensor:
    """Rows [b·k, (b+1)·k) of the full tensor (k = rows_per_block), as a (rows, cols) CPU tensor."""
    k = rows_per_block(shape)
    rows = min(k, shape[0] - b * k)
    cols = max(1, torch.Size(shape[1:]).numel())
    g = torch.Generator().manual_seed(block_seed(base, name, b))
    return torch.empty(rows, cols).normal_(0.0, std, generator=g)


@torch.no_grad()
def fill_(out: torch.Tensor, rule: InitRule, base: int, name: str, full_shape: tuple[int, ...],
          rows: torch.Tensor | None = None, cols: slice | None = None) -> torch.Tensor:
    """Write into `out` the values of `full[rows][:, cols]` of parameter `name`'s initialisation.

    `rows`: indices into the full tensor's first dimension (None: all; ≥ full rows: padding, zeros);
    `cols`: a slice of the flattened trailing dimensions (None: all). `out` has the selected shape.
    """
    if rule.kind == "zeros":
        return out.zero_()
    if rule.kind == "ones":
        return out.fill_(1.0)
    if rule.kind != "normal":
        raise ValueError(f"unknown init rule {rule.kind!r} for {name}")
    if len(full_shape) == 1:  # a vector: each value is a row (a column-parallel bias shares the weight's rows)
        full_shape = (full_shape[0], 1)
    n_rows = full_shape[0]
    want = torch.arange(n_rows) if rows is None else rows.to(torch.int64).cpu()
    flat = out.view(len(want), -1)
    valid = want < n_rows
    if not bool(valid.all()):
        flat[(~valid).nonzero().flatten().to(out.device)] = 0.0
    # Group the wanted rows by block: sorted, each block's rows are one run of the order (no per-block scan).
    dst = valid.nonzero().flatten()
    src = want[dst]
    order = torch.argsort(src, stable=True)
    dst, src = dst[order], src[order]
    k = rows_per_block(full_shape)
    blocks, counts = torch.unique_consecutive(src // k, return_counts=True)
    start = 0
    for b, n in zip(blocks.tolist(), counts.tolist()):
        values = _block(base, name, full_shape, b, rule.std)  # (rows in block, cols)
        if cols is not None:
            values = values[:, cols]
        d, r = dst[start:start + n], src[start:start + n] - b * k
        start += n
        if n == values.shape[0] and int(d[-1] - d[0]) == n - 1 and int(r[0]) == 0:  # a whole block, in order
            flat[int(d[0]):int(d[0]) + n] = values.to(out.dtype)
        else:
            flat[d.to(out.device)] = values[r].to(out.dtype).to(out.device)
    return out


def init_parameters(model, rule) -> None:
    """Every parameter of a plain `model` from its `init_seed` by `rule(name, shape, cfg)` (a family's
    `init_rule`): the same values any shard of it gets when materialised alone."""
    for name, p in model.named_parameters():
        fill_(p.data, rule(name, tuple(p.shape), model.cfg), model.init_seed, name, tuple(p.shape))
