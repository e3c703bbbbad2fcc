"""From the meta device to this rank's real shards: allocate only what the rank holds, and initialise it.

A model built under `torch.device("meta")` has shapes and no storage; tensor parallelism then swaps its
modules for sharded ones (still meta) and the pipeline cut prunes other stages' modules. `materialize`
allocates the parameters and buffers that are left on `device` and fills every parameter with exactly
its part of the single-process initialisation (`models/init.py`: per-parameter, row-block seeding), so
no process ever holds more than its own shards plus one block of values. Parameters shared by several
modules (a tied embedding and head) stay one parameter; attributes set on a parameter by the transforms
(`sequence_parallel`) are kept.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.models.init import fill_, meta_device
from meshlm.parallel.tensor_layers import Sharded


def plain_shapes(spec, cfg) -> dict[str, tuple[int, ...]]:
    """Full shapes of the plain model's parameters (each tensor once), from a meta build."""
    with meta_device():
        model = spec.model_class(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _allocate(model: nn.Module, device: torch.device) -> None:
    """Real, uninitialised storage for every meta parameter and buffer (shared parameters stay shared)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # e.g. sequence_parallel
                made[id(p)] = new
            module._parameters[key] = made[id(p)]
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)


@torch.no_grad()
def materialize(model: nn.Module, spec, device: torch.device, seed: int | None = None) -> nn.Module:
    """Allocate `model`'s meta tensors on `device` and initialise each parameter as its shard of the
    single-process model of `spec`: a sharded module says which rows/columns it holds (`shard_index`),
    a replicated one holds all. `seed`: the base seed (default: the one the model drew when built)."""
    cfg = model.cfg
    seed = model.init_seed if seed is None else seed
    pending = {name for name, p in model.named_parameters() if p.is_meta}
    _allocate(model, device)
    full = plain_shapes(spec, cfg)
    for name, p in model.named_parameters():
        if name not in pending:
            continue
        prefix, _, attr = name.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        rows, cols = owner.shard_index(attr) if isinstance(owner, Sharded) else (None, None)
        if getattr(p, "expert_rows", None) is not None:  # this rank's experts (parallel/expert.py)
            rows = torch.arange(*p.expert_rows)
        fill_(p.data, spec.init_rule(name, full[name], cfg), seed, name, full[name], rows, cols)
    model.init_buffers(device)  # the family's protocol (families/spec.py): every buffer, computed
    return model

