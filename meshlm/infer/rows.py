"""bf16 linears whose decoding rows multiply through meshlm's own kernel (`meshlm::bf16_rows`, models/native.py).

A step that decodes one row per sequence multiplies a few activation rows by every weight: a read of the weights,
bound by memory. On a CPU whose native bf16 is AVX512-BF16 without AMX, oneDNN's bf16 product read one SmolLM2
row's 270 MB of weights at 26 GB/s where `torch.sum` reads 36 (benchmarks/RESULTS.md, "Every pair on the
AVX512-BF16 EPYC after the serving rounds"); meshlm's kernel (`models/kernels/bf16_rows.cpp`: `vdpbf16ps`, 32
inputs' pair products an instruction, the weight read once with software prefetch) reads it closer to memory speed
(RESULTS.md, "bf16 rows of meshlm's own").

`use_bf16_rows(model)` turns the model's plain bf16 `nn.Linear`s (the blocks' and the output head) into
`Bf16RowsLinear`s in place, where `wanted()`: the same module, weight (tied or not) and hooks, its class changed,
so adapters' hooks and a tied head keep working. A product of at most `ROWS` rows goes through the kernel, more
rows through `F.linear` (oneDNN's, which the kernel does not beat there); inside a compiled graph only a
one-row product (the one-token graph's: one client's decoding) takes the kernel, so the several-token graph,
compiled for dynamic token counts, never branches on its count. `MESHLM_BF16_KERNEL=0` keeps `F.linear` everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.core.precision import cpu_bf16_support
from meshlm.models import native

# Products of at most this many rows go through the kernel in an eager step: SmolLM2's 30 blocks and head, eagerly,
# 2 threads on a 2-core EPYC with AVX512-BF16, the kernel against oneDNN's F.linear: 1 row 8.4 against 24.3 ms, 4
# rows 11.3 against 20.3, 8 rows 16.7 against 21.7, 16 rows 22.0 against 20.6 (RESULTS.md, "bf16 rows of meshlm's
# own")
ROWS = 8


class Bf16RowsLinear(nn.Linear):
    """`nn.Linear` with a bf16 weight on the CPU whose products of at most `ROWS` rows of bf16 activations (one row
    inside a compiled graph) go through `meshlm::bf16_rows`: sums in fp32, rounded to bf16 once, as F.linear's.
    A product that autograd records (a model trained while it also generates, as online RL's policy) stays
    F.linear's: the operator has no derivative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        limit = 1 if torch.compiler.is_compiling() else ROWS
        recorded = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if (x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16 or rows > limit or rows == 0
                or recorded):
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.meshlm.bf16_rows.default(x.reshape(rows, self.in_features), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def wanted(model: nn.Module) -> bool:
    """Whether `use_bf16_rows` changes `model`: bf16 linear weights on the CPU, a CPU whose native bf16 is
    AVX512-BF16 without AMX (there oneDNN's one-row products were measured below memory speed; with AMX they were
    not measured against the kernel), and the kernel built (`native.unavailable("bf16_rows")` says why not)."""
    return bool(_targets(model)) and _kernel_for(force=False)


def _kernel_for(force: bool) -> bool:
    """`wanted`'s rule for the CPU (or `force`, for tests), and the kernel built."""
    return (force or cpu_bf16_support() == "AVX512-BF16") and native.bf16_rows() is not None


def _targets(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight is not None
            and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu" and m.weight.is_contiguous()]


def use_bf16_rows(model: nn.Module, force: bool = False) -> int:
    """Turn `model`'s plain bf16 CPU linears into `Bf16RowsLinear`s in place where `wanted(model)` (or `force`, for
    tests, where the kernel is built); the number turned."""
    found = _targets(model)
    if not found or not _kernel_for(force):
        return 0
    for module in found:
        module.__class__ = Bf16RowsLinear
    return len(found)
