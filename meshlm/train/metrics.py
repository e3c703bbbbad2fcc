"""Throughput accounting: model FLOPs (Megatron's formula), TFLOP/s, MFU, HFU, peak device and memory.

Model FLOPs per step (FORMULAS.md; causal attention counted once; e = 3 with SwiGLU else 2):
    F = 6·T·[L·(e·h·f + h·(k·a + 2·k·g) + k·a·h) + h·V] + 6·S2·L·k·a,   S2 = Σ s_i² = B·s²
MFU = F / (time · peak). HFU adds the forward FLOPs that recomputation does again.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

from meshlm.config import ModelConfig


def layer_flops_per_token(m: ModelConfig) -> float:
    """Forward+backward FLOPs per token of one layer's matmuls (no attention scores, no head)."""
    e = 3 if m.activation == "swiglu" else 2
    h, f, k, a, g = m.hidden_size, m.ffn_size, m.head_dim, m.n_heads, m.kv_heads
    return 6.0 * (e * h * f + h * (k * a + 2 * k * g) + k * a * h)


def model_flops(m: ModelConfig, batch: int, seq_len: int | None = None) -> float:
    """Model FLOPs of one training step on `batch` full-length sequences (forward + backward)."""
    s = seq_len or m.seq_len
    tokens = batch * s
    dense = tokens * (m.n_layers * layer_flops_per_token(m) + 6.0 * m.hidden_size * m.vocab_size)
    attention = 6.0 * batch * s * s * m.n_layers * m.head_dim * m.n_heads
    return dense + attention


def recompute_flops(m: ModelConfig, batch: int, recompute: str, seq_len: int | None = None,
                    layers: int | None = None) -> float:
    """Extra forward FLOPs done again by activation recomputation (for HFU), over `layers` recomputed
    layers (default every layer; `meshlm.parallel.recompute.recomputed_layers` counts them)."""
    s = seq_len or m.seq_len
    n = m.n_layers if layers is None else layers
    if recompute == "full":
        per_layer = batch * s * layer_flops_per_token(m) / 3 + 2.0 * batch * s * s * m.head_dim * m.n_heads
        return n * per_layer
    if recompute == "selective":  # the attention core only: QKᵀ and ·V, causal counted once
        return n * 2.0 * batch * s * s * m.head_dim * m.n_heads
    return 0.0


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Achievable matmul TFLOP/s on this device and dtype, from a short square-matmul loop."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up
    _sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        count += 1
        if device.type == "cuda" and count % 10:
            continue
        _sync(device)
    _sync(device)
    elapsed = time.perf_counter() - start
    return 2.0 * n ** 3 * count / elapsed / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory (CUDA allocator) or the process's peak resident set size (CPU), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the records of `path` (metrics.jsonl) up to `step`, atomically; unparsable lines (torn by a
    kill) are dropped. Returns how many were."""
    keep, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            torn += line.strip() != ""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return torn
