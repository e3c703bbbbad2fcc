"""Weight-only quantization for inference on a CPU (`--quantize int8|int4`; docs/serving.md).

The linears of the transformer blocks (attention `qkv`/`proj`, MLP `fc`/`proj`) are replaced, after the model
is loaded, by modules that keep their weight packed and call PyTorch's CPU kernels for packed matrix products
(the ones gpt-fast and torchao use). The activations enter the kernels in bfloat16 when the model is float32
(`kernel_dtype`: those kernels' float32 path is a slow scalar loop) and leave them in the model's dtype:

* `int8`: one symmetric scale per output channel, s_n = max_k |W_nk| / 127, q = round(W / s) in [-127, 127];
  `aten._weight_int8pack_mm(x, q, s)` = x (q·s)ᵀ.
* `int4`: per output channel and group of `group_size` inputs (32, 64 or 128), an asymmetric scale and zero
  point from the group's minimum and maximum: s = (max - min) / 15, q = round((W - min) / s) in [0, 15], and
  the kernel's dequantization W ≈ (q - 8)·s + z with z = min + 8·s. `aten._convert_weight_to_int4pack_for_cpu`
  packs q once; `aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` multiplies.
  A GGUF Q4_1 block (32 values, w = q·d + m) is exactly this form with group size 32, which is why int4 with
  the default group finds a Q4_1 file's own codes again (docs/serving.md gives the measurement).

On a CPU without native bf16 the decoding rows take meshlm's own kernel instead (`own_kernel`: activations in 8-bit
blocks, int4 codes in its own layout, an int4 prefill through the dequantized weight as int8's).

The output head goes to int8 too unless `head=False` (under int4 as well, as llama.cpp's Q4 files keep their
output matrix in Q8_0; measured in `quantize_model`'s docstring); the embedding and norms stay in the model's
dtype. Only a plain (one-process) model on the CPU is quantized: tensor-parallel linears split
their matrix products over ranks and are refused. Forward hooks on a replaced linear (LoRA adapters served
unmerged, `infer/adapters.py`) keep running on the quantized module's output, called with the original
module, so an adapter's update adds to the quantized base product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.core.config import ConfigError
from meshlm.core.precision import cpu_bf16_support
from meshlm.models import native

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
INT4_N_MULTIPLE = 16  # the int4 CPU packing takes output channels in tiles of 16
_KERNELS = {"int8": ("_weight_int8pack_mm",),
            "int4": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")}


def check_kernels(mode: str) -> None:
    """ConfigError unless `mode` is known and this torch ships its packed CPU kernels (torch >= 2.6)."""
    if mode not in MODES:
        raise ConfigError(f"--quantize {mode!r} is not a mode; choose int8 or int4")
    missing = [name for name in _KERNELS[mode] if not hasattr(torch.ops.aten, name)]
    if missing:
        raise ConfigError(f"--quantize {mode} needs torch.ops.aten.{missing[0]}, which torch {torch.__version__} "
                          "lacks; upgrade torch (2.6 or later) or serve without --quantize")


# ---- the codes ---------------------------------------------------------------------------------------------------
def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scales float32 (N,)) with W ≈ q · s[:, None], symmetric per output channel."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 in 0..15 (N, K), scales (N, K/g), zeros (N, K/g)), float32, with
    W ≈ (q - 8) · s + z per group of `group_size` inputs (z = min + 8 s: the kernel's zero point)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # (N, K/g, g)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, low + 8 * scales


# ---- the modules -------------------------------------------------------------------------------------------------
# From this many rows on, an int8 layer dequantizes its weight (q·s, in the compute dtype) and multiplies as a
# float matrix: `_weight_int8pack_mm`'s time grows with the rows (a loop of matrix-vector products) and passes
# dequantize-then-multiply at about 32 rows of a 576 → 1,536 layer in bf16 on 2 threads (0.46 against 0.43 ms;
# 512 rows: 6.7 against 2.9 ms; benchmarks/RESULTS.md, "Serving three ways"): a prefill chunk goes that way,
# decoding rows through the kernel.
DEQUANTIZE_ROWS = 32
# The same crossing inside a compiled step (`meshlm serve --compile`) comes at two rows: there the kernel's 16-row
# SmolLM2 bf16 decode step took 97-102 ms and the dequantized weight's 79-83 ms (a 16-client closed loop in
# process 96-102 against 132-142 output tokens/s; benchmarks/RESULTS.md, "One token's attention inside its
# graph"), while a single row stays the kernel's (3.6 ms for the 30 layers' products inside a graph). So every
# compiled graph of several tokens takes one branch, and no graph is compiled for the crossing. Nothing else
# PyTorch offers here is faster at 16 rows than this (1.47x a bf16 weight's time): Inductor's own weight-only
# int8 template (1.37x: without AMX it multiplies in fp32 vectors), the kernel (2.0x), or int8 activations
# through `torch._int_mm` (faster eagerly, but +2.3-4.0% perplexity on SmolLM2, over the 1% int8 may cost):
# benchmarks/int8_products.py, RESULTS.md "int8 at 16 rows". On a CPU with AMX the kernel inside a graph is
# Inductor's AMX template instead, faster than the dequantized weight at every size measured (30 SmolLM2 blocks'
# products: 16 rows 11.5 against 39.1 ms, 64 rows 20.4 against 56.0, 512 rows 85.8 against 137.8; faster than
# the bf16 weight too; RESULTS.md "int8 on AMX"): there a compiled step never dequantizes.
#
# On a CPU without native bf16 instructions (neither AVX512-BF16 nor AMX: AVX2 CPUs such as AMD's Zen 1-3)
# PyTorch emulates a bf16 matrix product, and the dequantized weight in bf16 is the slowest form of all: 128 rows
# of a 576 → 1,536 layer took 21.1 ms in bf16 against 3.0 ms dequantized in fp32, 3.7 ms through the kernel and 1.5
# ms for the fp32 weight (2 threads on a 2-core AMD EPYC with AVX2 only; 16 rows: 3.0, 0.83, 0.52 and 0.38 ms). The
# kernel itself is fine there (its bf16 path converts with AVX2), so only the dequantized branch changes: it
# multiplies in fp32 (`Int8Linear.dequantize_dtype`), and a compiled step keeps the eager crossing, where inside a
# graph the kernel also led at 16 rows (0.57 against 1.41 ms) and the fp32 dequantized weight from 64 (1.82
# against 2.14): RESULTS.md, "An AVX2 host".
NATIVE_BF16 = cpu_bf16_support() is not None


def _compiled_dequantize_rows() -> int:
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # what Inductor's CPU code generator asks
    if amx is not None and amx():
        return 1 << 62
    return 2 if NATIVE_BF16 else DEQUANTIZE_ROWS


COMPILED_DEQUANTIZE_ROWS = _compiled_dequantize_rows()


# On such a CPU the decoding rows (fewer than DEQUANTIZE_ROWS) of an eager step multiply through meshlm's own kernel
# (`models/kernels/quant_rows.cpp`): the activations rounded to 8 bits per block of 32, products of bytes summed in
# AVX2 registers, the codes read once. One row of SmolLM2's block linears and int8 head took 17.2 ms in int8 against
# PyTorch's kernel's 27.9 (int4 15.4 against 19.7). Inside a compiled step PyTorch's int8 product (Inductor's own
# code there) stays faster even with meshlm's called from C++ (a one-row step 10.4-11.7 ms against 12.2-13.5), and
# the 8-bit activations cost perplexity (every scored row through the kernel: int8 +0.75% against PyTorch's +0.50%,
# int4 +1.34% against +0.24%), so a compiled int8 step keeps PyTorch's kernel; int4, whose codes are packed once in
# the kernel's own layout, keeps meshlm's (RESULTS.md, "int8 and int4 rows of meshlm's own" and "The quantized rows
# as C++ operators"). With native bf16 PyTorch's kernels stay (not measured against it there).
# `own_kernel()` says which; MESHLM_QUANT_KERNEL=0 keeps PyTorch's anywhere.
def own_kernel() -> bool:
    """Whether quantized layers built now take meshlm's own few-row kernel: on a CPU without native bf16, where the
    kernel builds (AVX2 and FMA, a compiler; `native.unavailable("quant_rows")` says why not)."""
    return not NATIVE_BF16 and native.quant_rows() is not None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes q (N, K) in 0..15 as `kernels/quant_rows.cpp` reads them: (N, K/2) uint8, per 32 inputs 16 bytes whose
    low halves hold the first 16 codes and high halves the next 16."""
    n, k = q.shape
    runs = q.reshape(n, k // 32, 2, 16).to(torch.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: (N, K) uint8 codes."""
    n, half = packed.shape
    runs = packed.reshape(n, half // 16, 1, 16)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(n, 2 * half)


def _branches(compute_dtype: torch.dtype, in_features: int, own: bool | None) -> tuple[torch.dtype, bool]:
    """A quantized layer's (dequantize_dtype, own): its dequantized product in fp32 where its compute dtype is bf16
    and the CPU does not compute bf16 natively; meshlm's kernel (`own`, default `own_kernel()`) where it takes the
    layer: scales in fp32 or bf16, inputs in blocks of 32."""
    emulated = compute_dtype == torch.bfloat16 and not NATIVE_BF16
    own = (own_kernel() if own is None else own) and compute_dtype in native.DTYPES and in_features % 32 == 0
    return (torch.float32 if emulated else compute_dtype), own


def _crossings(module: nn.Module) -> tuple[float, float]:
    """(eager, compiled) row counts from which `module` multiplies by its dequantized weight: DEQUANTIZE_ROWS and
    COMPILED_DEQUANTIZE_ROWS (the same where meshlm's kernel is the default), except for PyTorch's int4 kernel,
    kept at every size."""
    if isinstance(module, Int8Linear) or module.own:
        return DEQUANTIZE_ROWS, COMPILED_DEQUANTIZE_ROWS
    return float("inf"), float("inf")


def compiled_crossing(model: nn.Module) -> int | None:
    """The token count from which a compiled step of `model` takes another branch than one of fewer tokens (its
    quantized layers' compiled crossing), where that splits the several-token graph in two (above 2 and bounded: on
    a CPU without native bf16, or with meshlm's own kernel); None where every several-token step takes the same
    branch."""
    found = [c for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))
             if 2 < (c := _crossings(m)[1]) < 1 << 62]
    return min(found) if found else None


class Int8Linear(nn.Module):
    """y = x (q·s)ᵀ + b through `aten._weight_int8pack_mm`; x (any leading shape) enters the kernel in
    `compute_dtype` and y leaves it in x's dtype. `DEQUANTIZE_ROWS` rows and more (`COMPILED_DEQUANTIZE_ROWS` in a
    compiled step: two, never on a CPU with AMX, `DEQUANTIZE_ROWS` on one without native bf16) multiply by the
    dequantized weight instead: the same q·s in `dequantize_dtype`, the compute dtype, or fp32 where that is bf16
    and the CPU does not compute bf16 natively (x then enters that product unrounded). With `own` (default
    `own_kernel()`) fewer rows than DEQUANTIZE_ROWS of an eager step go through meshlm's kernel instead (x in 8-bit
    blocks of 32, the same codes and scales); it takes input widths that are multiples of 32."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype | None = None, own: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype or linear.weight.dtype
        self.dequantize_dtype, self.own = _branches(self.compute_dtype, self.in_features, own)
        q, scales = int8_codes(linear.weight)
        self.register_buffer("qweight", q)  # (N, K) int8
        self.register_buffer("scales", scales.to(self.compute_dtype))  # (N,): the kernel takes them in x's dtype
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # a matrix: (B·T, K)
        eager, compiled = _crossings(self)
        if flat.shape[0] >= (compiled if torch.compiler.is_compiling() else eager):
            d = self.dequantize_dtype
            y = F.linear(flat.to(d), self.qweight.to(d) * self.scales.to(d)[:, None])
        elif self.own and not torch.compiler.is_compiling():  # inside a graph PyTorch's kernel (`own_kernel`)
            y = torch.ops.meshlm.int8_rows.default(flat.float().contiguous(), self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat.to(self.compute_dtype).contiguous(), self.qweight,
                                                   self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, "
                f"{str(self.compute_dtype).removeprefix('torch.')} compute")


class Int4Linear(nn.Module):
    """y = x Wᵀ + b with W = (q - 8)·s + z per group, through `aten._weight_int4pack_mm_for_cpu`; with `own` (default
    `own_kernel()`) through meshlm's kernel below Int8Linear's crossing (x in 8-bit blocks for the codes' part) and
    the dequantized weight (in `dequantize_dtype`, as Int8Linear's) from there on, the codes then packed in that
    kernel's layout (`pack_int4`)."""

    def __init__(self, linear: nn.Linear, group_size: int, compute_dtype: torch.dtype | None = None,
                 own: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size, self.compute_dtype = group_size, compute_dtype or linear.weight.dtype
        self.dequantize_dtype, self.own = _branches(self.compute_dtype, self.in_features, own)
        q, scales, zeros = int4_codes(linear.weight, group_size)
        pairs = torch.stack([scales, zeros], dim=-1).to(self.compute_dtype)  # (N, K/g, 2): [scale, zero]
        if self.own:
            self.register_buffer("packed", pack_int4(q))  # (N, K/2) uint8
            self.register_buffer("scales_and_zeros", pairs.contiguous())
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # (K/g, N, 2): the layout PyTorch's kernel reads
            self.register_buffer("scales_and_zeros", pairs.transpose(0, 1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (B·T, K)
        eager, compiled = _crossings(self)
        if flat.shape[0] >= (compiled if torch.compiler.is_compiling() else eager):
            d, g = self.dequantize_dtype, self.group_size
            codes = unpack_int4(self.packed).reshape(self.out_features, -1, g).to(d)
            pairs = self.scales_and_zeros.to(d)
            weight = (codes - 8) * pairs[..., :1] + pairs[..., 1:]
            y = F.linear(flat.to(d), weight.reshape(self.out_features, self.in_features))
        elif self.own:
            y = torch.ops.meshlm.int4_rows.default(flat.float().contiguous(), self.packed, self.scales_and_zeros,
                                                   self.group_size)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(self.compute_dtype).contiguous(), self.packed,
                                                           self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of "
                f"{self.group_size}, {str(self.compute_dtype).removeprefix('torch.')} compute")


# ---- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantizeReport:
    """What `quantize_model` did: layers replaced and kept, and the model's weight bytes before and after."""

    mode: str
    group_size: int
    layers: int  # replaced, the head included
    kept: int  # int4: linears whose output size the packing cannot take, left in the model's dtype
    head: bool
    bytes_before: int
    bytes_after: int
    compute_dtype: torch.dtype = torch.float32
    own: int = 0  # layers whose decoding rows go through meshlm's kernel (x in 8-bit blocks there)

    def line(self) -> str:
        kind = f"int4 (groups of {self.group_size})" if self.mode == "int4" else "int8 (per channel)"
        also = " and the output head (int8)" if self.head else ""
        kept = f", {self.kept} kept in float" if self.kept else ""
        compute = str(self.compute_dtype).removeprefix("torch.")
        own = f" (8-bit blocks in meshlm's kernel for the decoding rows of {self.own} layers)" if self.own else ""
        return (f"weights quantized to {kind}: {self.layers - self.head} block linears{also}{kept}, {compute} "
                f"activations{own}; weight bytes "
                f"{self.bytes_before / 2**20:,.1f} MiB -> {self.bytes_after / 2**20:,.1f} MiB")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.dtype, t.shape)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _targets(model: nn.Module, head: bool) -> list[tuple[str, nn.Linear]]:
    """The plain linears of the transformer blocks (`layers.*`), and the output head when `head`."""
    from meshlm.parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear

    if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules()):
        raise ConfigError("--quantize quantizes a model served in one process; drop --parallel.tp (tensor-parallel "
                          "shards are not quantized)")
    if not isinstance(getattr(model, "layers", None), nn.ModuleList):
        raise ConfigError(f"--quantize takes a decoder (GPT family) model, not a {type(model).__name__}")
    found = [(f"layers.{name}", m) for name, m in model.layers.named_modules() if type(m) is nn.Linear]
    if head and type(getattr(model, "lm_head", None)) is nn.Linear:
        found.append(("lm_head", model.lm_head))
    return found


def _replace(model: nn.Module, path: str, old: nn.Linear, new: nn.Module) -> None:
    """Put `new` at `path`; forward hooks of `old` keep running on `new`'s output, called with `old`
    (a hook may key its state on the module, as `infer/adapters.py` does); `old` keeps no weight."""
    if old._forward_pre_hooks or old._forward_hooks_with_kwargs or old._backward_hooks:
        raise ConfigError(f"--quantize: {path} carries hooks the quantized layer cannot keep; serve without "
                          "--quantize")
    for hook in old._forward_hooks.values():
        new.register_forward_hook(lambda _module, args, output, hook=hook, old=old: hook(old, args, output))
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)
    if old._forward_hooks:  # kept alive for its hooks' sake: drop the float weight it would hold
        old.weight = None


def kernel_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype inside the packed kernels: bfloat16 for a float32 model, whose float32 path
    in ATen is a scalar loop (measured on this AVX-512 host, one thread, 576 -> 1536: int8 2.2 ms and int4
    5.0 ms a row against 0.26 and 0.23 ms in bfloat16, and 0.25 ms for the float32 linear), else the model's."""
    return torch.bfloat16 if model_dtype == torch.float32 else model_dtype


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, group_size: int = 32, head: bool = True,
                   compute_dtype: torch.dtype | None = None, own: bool | None = None) -> QuantizeReport:
    """Replace the linears of `model`'s transformer blocks by packed `mode` ("int8" | "int4") modules (and
    the output head by an int8 one when `head`), in place; the embedding and norms stay as they are. Inputs
    enter the kernels in `compute_dtype` (default `kernel_dtype` of the model's), outputs come back in the
    model's dtype. `own`: the decoding rows through meshlm's kernel (default `own_kernel()`) or PyTorch's.

    The head is on by default, measured in benchmarks/quantize_quality.py on SmolLM2-135M (a 49,152-token
    vocabulary, a fifth of the weights): decoding 1.35-1.46x faster for +0.1-0.25% perplexity. With tied
    embeddings it is a second copy of the embedding matrix (27 MiB there), the embedding staying in float."""
    check_kernels(mode)
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise ConfigError(f"--quantize-group-size {group_size} is not supported; choose 32, 64 or 128")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError(f"--quantize runs PyTorch's packed CPU kernels; the model is on {device.type}; run on a "
                          "CPU (CUDA_VISIBLE_DEVICES=) or serve without --quantize")
    targets = _targets(model, head)
    blocks = [(p, m) for p, m in targets if p != "lm_head"]
    if mode == "int4":
        bad = next(((p, m) for p, m in blocks if m.in_features % group_size), None)
        if bad is not None:
            fits = [g for g in GROUP_SIZES if all(m.in_features % g == 0 for _, m in blocks)]
            hint = f"use --quantize-group-size {' or '.join(map(str, fits))}" if fits else "use --quantize int8"
            raise ConfigError(f"--quantize int4: groups of {group_size} do not divide {bad[0]}'s "
                              f"{bad[1].in_features} inputs; {hint}")
    before = weight_bytes(model)
    compute_dtype = compute_dtype or kernel_dtype(next(model.parameters()).dtype)
    replaced = kept = 0
    for path, linear in targets:
        if mode == "int4" and path != "lm_head" and linear.out_features % INT4_N_MULTIPLE:
            kept += 1  # e.g. a one-output gate: the packing takes channels in tiles of 16
            continue
        int8 = mode == "int8" or path == "lm_head"  # the head in int8 under int4 too (as Q4 GGUF files keep Q8_0)
        new = Int8Linear(linear, compute_dtype, own) if int8 else Int4Linear(linear, group_size, compute_dtype, own)
        _replace(model, path, linear, new)
        replaced += 1
    model.requires_grad_(False)
    head = any(path == "lm_head" for path, _ in targets)  # asked for, and a plain linear to replace
    own = sum(1 for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear)) and m.own)
    return QuantizeReport(mode, group_size, replaced, kept, head, before, weight_bytes(model), compute_dtype, own)


@dataclass(frozen=True)
class QuantizeOptions:
    """`--quantize MODE`, `--quantize-group-size N` and `--quantize-float-head` (head=False) as the commands
    pass them on."""

    mode: str
    group_size: int = 32
    head: bool = True

    def __post_init__(self):
        check_kernels(self.mode)
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"--quantize-group-size {self.group_size} is not supported; choose 32, 64 or 128")

    def apply(self, model: nn.Module) -> QuantizeReport:
        return quantize_model(model, self.mode, self.group_size, self.head)

    def check_serving(self, given: str, decoder: bool, tp: int, runtime_lora: bool = False) -> None:
        """ConfigError, before anything is loaded, for what a quantized model cannot serve: an encoder
        checkpoint, tensor parallelism, and LoRA adapters loaded at run time (they attach to float linears;
        `--adapter` ones are attached before quantizing and keep working)."""
        if not decoder:
            raise ConfigError(f"--quantize serves GPT-family (decoder) checkpoints; {given} is an encoder (BERT) "
                              "checkpoint: drop --quantize")
        if tp > 1:
            raise ConfigError(f"--quantize serves in one process; drop --parallel.tp={tp} (tensor-parallel shards are "
                              "not quantized) or --quantize")
        if runtime_lora:
            raise ConfigError("--allow-runtime-lora attaches LoRA to float weights while serving; with --quantize give "
                              "the adapters at start (--adapter) instead")
