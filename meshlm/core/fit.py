"""Will it fit? This machine's memory, and the check that refuses a run needing more (the family-free part;
the bytes a family's run needs are counted in `train/fit.py`).

The estimates leave out the runtime, the allocator's slack and the data, so they are lower bounds: a run
is refused only when even they exceed the memory, never because it might not fit.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshlm.core.config import Config, ConfigError, ModelConfig
from meshlm.core.mla import cached_width

GIB = 2 ** 30
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory(device_type: str = "cpu") -> tuple[int, str]:
    """(bytes, what they are): the GPU's memory on CUDA, else physical memory (or a smaller cgroup limit)."""
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():  # a CPU-only torch, or no GPU visible
            raise ConfigError("train.device='cuda' but no CUDA GPU is visible to this torch; use train.device=auto "
                              "or cpu")
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        return torch.cuda.get_device_properties(index).total_memory, "GPU memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and 0 < int(limit) < total:
            return int(limit), "memory (cgroup limit)"
    return total, "physical memory"


def device_type_of(cfg: Config) -> str:
    if cfg.train.device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


def kv_cache_bytes(m: ModelConfig, batch: int, tokens: int) -> float:
    """fp32 keys and values of every layer for `tokens` positions."""
    return 2.0 * 4 * m.n_layers * batch * tokens * cached_width(m)  # kv_heads·head_dim (MLA: core/mla.py)


def check_fits(needed: dict[str, float], what: str, fix: str, device_type: str = "cpu") -> None:
    """ConfigError with the estimate, the machine's memory and `fix`, when `needed` exceeds it."""
    total = sum(needed.values())
    memory, kind = machine_memory(device_type)
    if total <= memory:
        return
    parts = ", ".join(f"{name} {value / GIB:,.1f}" for name, value in needed.items() if value)
    raise ConfigError(f"{what} needs at least {total / GIB:,.1f} GiB per process ({parts} GiB) but this machine "
                      f"has {memory / GIB:,.1f} GiB of {kind}; {fix}")
