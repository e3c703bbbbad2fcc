"""The layout object and the dropout stream tracker, in one process (no torch.distributed needed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshlm.core.config import ConfigError, ParallelConfig
from meshlm.parallel.mesh import ParallelDims, factor_world, init_distributed
from meshlm.parallel.rng import TPRNGTracker


def test_world_of_one_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dims = init_distributed(ParallelConfig())
    assert not dist.is_initialized()
    assert (dims.pp, dims.dp, dims.tp, dims.world_size, dims.rank, dims.tp_rank) == (1, 1, 1, 1, 0, 0)
    assert dims.tp_group is None and dims.dp_group is None and dims.pp_group is None and dims.mesh is None
    assert dims.is_main
    dims.barrier()  # a no-op, not an error


def test_world_that_does_not_factor_names_the_keys():
    assert factor_world(8, tp=2, pp=2) == (2, 2, 2)
    assert factor_world(8, tp=4, pp=1, dp=2) == (1, 2, 4)
    with pytest.raises(ConfigError, match="parallel.tp=4 × parallel.pp=1"):
        factor_world(6, tp=4, pp=1)
    with pytest.raises(ConfigError, match="parallel.dp=3"):
        factor_world(8, tp=2, pp=2, dp=3)
    with pytest.raises(ConfigError, match="parallel.tp=2"):
        ParallelDims.build(tp=2)  # a world of one process cannot hold tp=2


def test_rank_coordinates_put_tp_innermost():
    dims = ParallelDims(pp=2, dp=2, tp=2, rank=5)  # 5 = (1·2 + 0)·2 + 1
    assert dims.coords == (1, 0, 1) and (dims.pp_rank, dims.dp_rank, dims.tp_rank) == (1, 0, 1)


def test_tp_rng_is_its_own_stream_and_leaves_the_default_alone():
    torch.manual_seed(0)
    expected_default = torch.rand(4)
    torch.manual_seed(0)
    tracker = TPRNGTracker(seed=0, tp_rank=1)
    with tracker.tp_rng():
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), expected_default), "the default stream must continue untouched"
    assert not torch.equal(inside, expected_default)
    with tracker.tp_rng():
        second = torch.rand(4)
    assert not torch.equal(inside, second), "the tp stream advances between uses"


def test_tp_rng_state_round_trips_and_differs_per_rank():
    a, b = TPRNGTracker(7, tp_rank=0), TPRNGTracker(7, tp_rank=1)
    state = a.get_state()
    with a.tp_rng():
        first = torch.rand(8)
    a.set_state(state)
    with a.tp_rng():
        assert torch.equal(torch.rand(8), first), "a restored state redraws the same numbers"
    with b.tp_rng():
        assert not torch.equal(torch.rand(8), first), "another tp rank draws other numbers"
    with TPRNGTracker(7, tp_rank=0).tp_rng():
        assert torch.equal(torch.rand(8), first), "the stream is a function of (seed, tp rank)"
