"""Throughput accounting: the measured peak, peak memory. The FLOPs formulas (Megatron's; MFU, HFU) are
torch-free in `meshlm/core/flops.py` and each model family names its own (`ModelSpec.flops`)."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch


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
