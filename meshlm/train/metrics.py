"""Throughput accounting: the measured peak, peak memory. The FLOPs formulas (Megatron's; MFU, HFU) are
torch-free in `meshlm/core/flops.py` and each model family names its own (`ModelSpec.flops`)."""

from __future__ import annotations

import json
import os
import re
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.models.moe import moe_layers


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


def moe_groups(dims, sp: bool) -> list:
    """The process groups whose ranks route different tokens through the same MoE layers: the weights' replicas
    (dp × cp) and, under sequence parallelism, the tp ranks. Sums over them give the global expert load."""
    groups = [dims.dpcp_group] if dims.dp * dims.cp > 1 else []
    return groups + ([dims.tp_group] if sp and dims.tp > 1 else [])


def mtp_groups(dims) -> list:
    """The groups over which multi-token prediction losses are summed: the replicas (dp × cp) and the pipeline
    (only its last stage holds the modules; the others add zeros)."""
    return ([dims.dpcp_group] if dims.dp * dims.cp > 1 else []) + ([dims.pp_group] if dims.pp > 1 else [])


def mtp_metrics(model, depth: int, groups=()) -> dict:
    """Multi-token prediction's losses since the last call (`models/mtp.py`), averaged over the micro-batches and
    summed over `groups` (one collective; every rank with `depth` > 0 calls it): `mtp_loss_k` (CE of depth k) and
    `mtp_loss` (their mean, the term weighted by model.mtp_loss_weight). {} when depth is 0."""
    if not depth:
        return {}
    modules = getattr(model, "mtp", None)
    taken = modules.take_stats() if modules is not None else None
    vec = torch.zeros(depth + 1, device=next(model.parameters()).device)
    if taken is not None:
        vec[:depth], vec[depth] = taken[0], taken[1]
    for group in groups:
        dist.all_reduce(vec, group=group)
    calls = max(float(vec[depth]), 1.0)
    rec = {f"mtp_loss_{k + 1}": float(vec[k]) / calls for k in range(depth)}
    rec["mtp_loss"] = sum(rec.values()) / depth
    return rec


def moe_metrics(model, groups=()) -> dict:
    """Every MoE layer's statistics since the last call, summed over `groups` (one collective; every rank calls
    it): per layer i, `moe_load_i` (the share of routed assignments per expert), `moe_aux_i` and `moe_z_i` (the
    mean unscaled aux and z losses), `moe_dropped_i` (share of assignments over capacity); and over the layers
    `moe_aux`, `moe_max_load` (the largest expert share × experts: 1 is perfect balance) and `moe_dropped`.
    {} without MoE layers. Under pipeline parallelism: the layers of this rank's stages."""
    layers = moe_layers(model)
    if not layers:
        return {}
    vecs = []
    for _, m in layers:
        s = m.take_stats()
        E = m.experts.n_experts
        if s is None:
            vecs.append(torch.zeros(E + 4, device=m.router.weight.device))
        else:
            vecs.append(torch.cat([s["counts"], torch.stack([s["dropped"], s["aux"], s["z"], s["tokens"]])]))
    flat = torch.cat(vecs).float()
    for group in groups:
        dist.all_reduce(flat, group=group)
    rec, maxima = {}, []
    for position, ((name, _), vec) in enumerate(zip(layers, flat.split([len(v) for v in vecs]))):
        found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        mtp = re.search(r"(?:^|\.)mtp\.(\d+)\.", name)  # a multi-token prediction module's block (models/mtp.py)
        i = int(found.group(1)) if found else f"mtp{mtp.group(1)}" if mtp else position
        counts, (dropped, aux, z, tokens) = vec[:-4], vec[-4:].tolist()
        routed = max(float(counts.sum()), 1.0)
        rec[f"moe_load_{i}"] = [round(x, 5) for x in (counts / routed).tolist()]
        rec[f"moe_aux_{i}"] = aux / max(tokens, 1.0)
        rec[f"moe_z_{i}"] = z / max(tokens, 1.0)
        rec[f"moe_dropped_{i}"] = dropped / routed
        maxima.append(max(rec[f"moe_load_{i}"]) * len(counts))
    n = len(layers)
    rec["moe_aux"] = sum(v for k, v in rec.items() if k.startswith("moe_aux_")) / n
    rec["moe_dropped"] = sum(v for k, v in rec.items() if k.startswith("moe_dropped_")) / n
    rec["moe_max_load"] = max(maxima)
    return rec

