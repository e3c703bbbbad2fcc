"""`apply_data_parallel`: the gradient synchronisation a layout gets (`data.GradSync` without dp; DP
buckets reduced during backward and ZeRO-1/2 shards, `buckets.py`; ZeRO-3 through FSDP2, `fsdp.py`)."""

from __future__ import annotations

from torch import nn

from meshlm.core.config import Config
from meshlm.core.layout import check_data_parallel
from meshlm.families.spec import ModelSpec
from meshlm.parallel.buckets import BucketedDataParallel
from meshlm.parallel.data import GradSync
from meshlm.parallel.expert import ExpertDataParallel
from meshlm.parallel.fsdp import FullyShardedDataParallel
from meshlm.parallel.mesh import ParallelDims


def apply_data_parallel(model: nn.Module, dims: ParallelDims, cfg: Config, microbatches: int, pipe=None,
                        overlap: bool = True, *, spec: ModelSpec) -> GradSync:
    """The gradient synchronisation for this layout; call after every other transform (it hooks, flattens
    or shards the final parameters), then build the optimizer with `sync.build_optimizer`.

    `microbatches`: backward passes per step on this rank (the accumulation count, or the pipeline's m).
    """
    check_data_parallel(cfg, dims.tp)
    if dims.dpcp == 1:  # no replicas of the weights (dp × cp: context-parallel ranks hold the same weights)
        return GradSync(model, dims, pipe)
    if cfg.parallel.zero == 3:
        return FullyShardedDataParallel(model, dims, pipe, spec=spec)
    sync = BucketedDataParallel(model, dims, microbatches, cfg.parallel.zero, pipe, cfg.parallel.bucket_mb, overlap)
    if dims.ep > 1:  # the expert slices: reduced over their edp group (`expert.py`)
        return ExpertDataParallel(sync, cfg.parallel.sp)
    return sync
