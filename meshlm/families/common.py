"""What every built-in family computes the same way, written once for the family modules.

Each helper has the signature of a `ModelSpec` field, so a family module can name it directly; a new
family may use them too (`tests/families/toy_family.py` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from meshlm.core.config import Config, ModelConfig
from meshlm.core.flops import recompute_flops, stage_costs
from meshlm.core.layout import check_tensor_parallel
from meshlm.core.memory import layer_activation_bytes


def check_tp(cfg: ModelConfig, tp: int, sp: bool) -> None:
    """The shape rules of tensor parallelism shared by attention-and-MLP families (`core.layout`)."""
    check_tensor_parallel(cfg, tp, sp)


def recompute_extra_flops(cfg: ModelConfig, batch: int, mode: str, seq_len: int | None = None,
                          layers=None) -> float:
    """The extra forward FLOPs of activation recomputation (`core.flops.recompute_flops`)."""
    return recompute_flops(cfg, batch, mode, seq_len, layers)


def embedding_and_head_costs(cfg: ModelConfig) -> tuple[float, float]:
    """The first and last pipeline stage's extra work, in layers (`core.flops.stage_costs`)."""
    return stage_costs(cfg)


def activation_bytes(cfg: Config, **kw):
    """Per-layer saved bytes by meshlm's own formula (`core.memory.layer_activation_bytes`)."""
    return layer_activation_bytes(cfg, **kw)


def qkv_blocks(name: str, cfg: ModelConfig) -> list[tuple[str, int]] | None:
    """A fused `attn.qkv` parameter's layout-free checkpoint tensors q, k, v with their row counts; None
    for any other parameter."""
    prefix, attr = name.rsplit(".", 1)
    if not prefix.endswith("attn.qkv"):
        return None
    base, hd = prefix[:-len("qkv")], cfg.head_dim
    return [(f"{base}q.{attr}", cfg.n_heads * hd), (f"{base}k.{attr}", cfg.kv_heads * hd),
            (f"{base}v.{attr}", cfg.kv_heads * hd)]


# ---- Hugging Face name tables (interop/ reads them both ways; tune/ maps LoRA targets through them) ----
class Entry(NamedTuple):
    """One meshlm tensor and the Hugging Face tensors it is made of."""

    ours: str
    theirs: tuple[str, ...]  # concatenated along dim 0 into `ours`; () a tensor HF lacks: zero there
    transposed: bool = False  # GPT-2 Conv1D
    # Rows of each HF tensor when not `split_sizes`' (a shared expert's [gate; up]; a stacked MoE expert tensor
    # (E, rows, cols), read as (E * rows, cols): one HF tensor per expert, or two, [gate_j; up_j]).
    rows: tuple[int, ...] | None = None
    # One HF tensor stored in another layout than ours (gpt-oss's transposed, interleaved experts): functions
    # (ours → theirs, theirs → ours), exact copies both ways; None: the same layout.
    layout: tuple[Callable, Callable] | None = None


def split_sizes(cfg: ModelConfig, n_parts: int) -> list[int]:
    """Rows of each HF tensor stacked in a fused meshlm one: [q; k; v] or SwiGLU's [gate; up]."""
    if n_parts == 3:  # [q; k; v]
        return [cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
    return [cfg.ffn_size, cfg.ffn_size]  # [gate; up]


def entry_rows(cfg: ModelConfig, entry: Entry) -> list[int] | None:
    """Rows of each HF tensor of `entry` along dim 0 of its meshlm tensor (flattened to 2-D when stacked
    by expert); None for a tensor stored whole under one name."""
    if entry.rows is not None:
        return list(entry.rows)
    return split_sizes(cfg, len(entry.theirs)) if len(entry.theirs) > 1 else None
