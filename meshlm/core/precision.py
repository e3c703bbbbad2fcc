"""Mixed precision from one key, `train.precision`: auto, fp32, bf16 (autocast), fp16 (autocast + dynamic
loss scaling). Parameters and optimizer states stay fp32 (master weights); autocast casts per op.

`auto` (the default) resolves once, at start, by what the device computes natively (`native_half`):

* CUDA: bf16 where `torch.cuda.is_bf16_supported()` (Ampere and later), else fp16 (with the loss scaler);
* CPU: bf16 where the CPU has bf16 instructions (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo, or torch's
  dispatch capability reporting AMX) and the model is wide enough to gain from it (`CPU_BF16_MIN_HIDDEN`),
  fp32 elsewhere: on a CPU without them autocast emulates bf16 by converting, and runs slower than fp32;
* anything else: fp32.

The trainer prints the resolution ("precision: auto → bf16 (CPU AMX-BF16)") and records the resolved name in
the checkpoint's config, so a resumed run keeps it (`resume_precision`) whatever the host says then.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# From this width up, bf16 beats fp32 on a CPU with AMX-BF16; below it, the matmuls are too small for the
# conversions autocast adds around each (of weights and activations, per op) to pay off reliably. meshlm's
# step in bf16 against fp32, alternated in one run (benchmarks/train_step.py, 2-core Xeon with AMX-BF16,
# GPT-2 vocabulary, s = 128…1024; benchmarks/RESULTS.md, "Speed per step"): h = 384: 1.04–1.63×; h = 768: 1.04–1.71×
# (one 0.68× at a load average of 6, 1.07× when re-measured); h = 1024: 1.17–1.79×; h = 128 (s = 128, 1024
# tokens): 1.05×, and 1.04× in an earlier run: within this host's noise, so fp32 stays the choice there.
# h = 256 (measured later, same host, `--grid h256s256,h256s128 --precisions fp32,bf16`): 1.18× and 1.26×;
# the default run's shape (6 × 256, 4,096-token vocabulary, 16 × 256 tokens): 1.6× (7,183 against 4,398
# tokens/s over 30 steps each).
CPU_BF16_MIN_HIDDEN = 256


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _torch_says(name: str) -> bool:
    """torch's own CPU feature probe `torch.cpu.<name>()` (private; False where this torch lacks it)."""
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def cpu_bf16_support() -> str | None:
    """The CPU's native bf16 instructions ("AMX-BF16", "AVX512-BF16"), or None when it has neither: from
    /proc/cpuinfo's flags, or torch's probes where there is no /proc (they need an AVX-512 build of the kernels:
    `torch.backends.cpu.get_cpu_capability()` is AVX512 then)."""
    flags = cpu_flags()
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    if "amx_bf16" in flags or (not flags and avx512 and _torch_says("_is_amx_tile_supported")):
        return "AMX-BF16"
    if "avx512_bf16" in flags or (not flags and avx512 and _torch_says("_is_avx512_bf16_supported")):
        return "AVX512-BF16"
    return None


def native_half(device: torch.device) -> tuple[str, str] | None:
    """(precision, why) for the 16-bit format `device` computes natively, or None (fp32 only)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", f"CUDA {torch.cuda.get_device_name(device)} supports bf16"
        return "fp16", f"CUDA {torch.cuda.get_device_name(device)}: no bf16, fp16 with loss scaling"
    if device.type == "cpu":
        found = cpu_bf16_support()
        return ("bf16", f"CPU {found}") if found else None
    return None


def resolve_precision(precision: str, device: torch.device, hidden_size: int | None = None) -> tuple[str, str]:
    """(the precision to run, why): `precision` itself unless it is "auto"."""
    if precision != "auto":
        return precision, "set"
    half = native_half(device)
    if half is None:
        return "fp32", f"{device.type}: no native 16-bit matmul"
    name, why = half
    if device.type == "cpu" and hidden_size is not None and hidden_size < CPU_BF16_MIN_HIDDEN:
        return "fp32", (f"{why}, but model.hidden_size={hidden_size} < {CPU_BF16_MIN_HIDDEN}: bf16 is slower than "
                        "fp32 at this width on CPU")
    return name, why


def serving_dtype_note(name: str, device: torch.device) -> str | None:
    """A note for `--dtype NAME` of the serving commands where `device` does not compute it natively (it still
    runs, converting per operation, and slower than fp32), else None."""
    if name == "fp32" or device.type != "cpu":
        return None
    if name == "bf16" and cpu_bf16_support() is None:
        return ("--dtype bf16: this CPU has no native bf16 instructions (AVX512-BF16 or AMX-BF16); it runs, slower "
                "than fp32")
    if name == "fp16" and not {"avx512_fp16", "amx_fp16"} & cpu_flags():
        return "--dtype fp16: this CPU has no native fp16 matrix instructions (AMX-FP16); it runs, slower than fp32"
    return None


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, name: str | torch.dtype) -> torch.nn.Module:
    """`model`'s floating-point parameters in DTYPES[`name`] (or the dtype `name`), in place, for inference: the
    weights and, through them, the activations and the KV cache (which takes the parameters' dtype). Buffers stay
    as they are: the RoPE tables stay fp32 (`apply_rope` returns its input's dtype), a router's bias too."""
    dtype = DTYPES[name] if isinstance(name, str) else name
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def resume_precision(saved_config: dict | None) -> str | None:
    """The resolved precision a checkpoint's config recorded (None: not a known one)."""
    name = ((saved_config or {}).get("train") or {}).get("precision")
    return name if name in DTYPES else None


class Precision:
    def __init__(self, precision: str, device: torch.device):
        if precision not in DTYPES:
            raise ValueError(f"Precision takes a resolved precision ({', '.join(DTYPES)}), not {precision!r}; "
                             "resolve train.precision=auto with resolve_precision first")
        self.name, self.device = precision, device
        self.dtype = DTYPES[precision]
        # fp16 needs a loss scale so small gradients don't flush to zero; bf16 has fp32's range.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict) -> None:
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
