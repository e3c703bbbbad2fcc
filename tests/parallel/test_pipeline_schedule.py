"""Pure-data tests of pipeline parallelism: the layer partition, its validation, the micro-batch count,
and the interleaved schedule's order (torch's action lists, no processes).

The 1F1B order is checked in a real run (test_pipeline_end_to_end.py), because torch's `Schedule1F1B`
executes its own loop rather than its `pipeline_order` table (whose last-rank row is off in torch 2.13:
it lists forwards 1…m instead of 0…m−1).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from pipeline_orders import expected_1f1b, expected_interleaved, max_in_flight, simulate_bubble

from meshlm.core.config import ConfigError, load_config
from meshlm.core.flops import layer_flops_per_token, stage_costs
from meshlm.core.layout import microbatches_per_step, partition_layers, stage_layer_ranges
from meshlm.families.registry import get_spec
from meshlm.parallel.pipeline import pipeline_layers

GPT_SPEC = get_spec("gpt")


@pytest.mark.parametrize("head", [0.0, 0.26, 1.0, 2.5, 30.0])
def test_every_partition_holds_every_layer_exactly_once(head):
    """Unlike Megatron-LM issue #1304, no (n_layers, pp, vpp) drops or duplicates a layer."""
    for n_layers, pp, vpp in itertools.product(range(1, 41), range(1, 9), range(1, 4)):
        stages = pp * vpp
        if n_layers < stages:
            with pytest.raises(ConfigError, match="model.n_layers"):
                partition_layers(n_layers, pp, vpp, last_cost=head)
            continue
        counts = partition_layers(n_layers, pp, vpp, last_cost=head)
        assert len(counts) == stages and min(counts) >= 1
        ranges = stage_layer_ranges(counts)
        assert [i for r in ranges for i in r] == list(range(n_layers))  # each once, in order
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))


def _best_max_cost(n_layers: int, stages: int, extra: list[float]) -> float:
    best = float("inf")
    for cut in itertools.combinations(range(1, n_layers), stages - 1):  # every composition into ≥ 1 parts
        counts = [b - a for a, b in zip((0, *cut), (*cut, n_layers))]
        best = min(best, max(c + e for c, e in zip(counts, extra)))
    return best


@pytest.mark.parametrize("first,last", [(0.0, 0.0), (0.0, 0.26), (0.0, 2.0), (0.5, 3.7)])
def test_balancing_minimises_the_slowest_stage(first, last):
    for n_layers, stages in itertools.product(range(2, 13), range(2, 6)):
        if n_layers < stages:
            continue
        counts = partition_layers(n_layers, stages, 1, first_cost=first, last_cost=last)
        extra = [first] + [0.0] * (stages - 2) + [last]
        got = max(c + e for c, e in zip(counts, extra))
        assert got == pytest.approx(_best_max_cost(n_layers, stages, extra)), (n_layers, stages, counts)


def test_balanced_examples():
    assert partition_layers(30, 4, last_cost=0.25) == [7, 8, 8, 7]
    assert partition_layers(30, 4) == [7, 7, 8, 8]  # ties to the later stages (1F1B's early ones hold more)
    assert partition_layers(8, 4) == [2, 2, 2, 2]
    assert partition_layers(8, 2, 2, last_cost=2.0) == [2, 2, 3, 1]
    assert partition_layers(24, 4, last_cost=2.0) == [6, 6, 7, 5]  # stage costs 6, 6, 7, 7


def test_head_cost_comes_from_flops():
    m = load_config("gpt2-1.3b").model
    first, last = stage_costs(m)
    layer = layer_flops_per_token(m) + 6 * m.seq_len * m.head_dim * m.n_heads
    assert first == 0.0
    assert last == pytest.approx(6 * m.hidden_size * m.vocab_size / layer)
    assert 1.5 < last < 2.5  # the LM head of a 1.3B GPT costs about two layers
    tiny = load_config("gpt-tiny").model
    assert stage_costs(tiny)[1] > 20  # a 50k vocabulary on h = 128: the head outweighs the whole model


def test_explicit_pp_layers_from_the_config():
    cfg = load_config("gpt-tiny", ["--model.n_layers=30", "--parallel.pp=4", "--parallel.pp_layers=[7, 8, 8, 7]"])
    assert cfg.parallel.pp_layers == [7, 8, 8, 7]
    assert pipeline_layers(cfg, GPT_SPEC) == [7, 8, 8, 7]
    auto = load_config("gpt-tiny", ["--model.n_layers=7", "--parallel.pp=2"])
    assert pipeline_layers(auto, GPT_SPEC) == [6, 1], "gpt-tiny's head (50k vocabulary) is worth > 20 layers"


@pytest.mark.parametrize("overrides,match", [
    (["--parallel.pp=4", "--parallel.pp_layers=[2, 2, 2, 1]"], r"parallel.pp_layers=\[2, 2, 2, 1\] sums to 7"),
    (["--parallel.pp=2", "--parallel.pp_layers=[6, 0]"], "parallel.pp_layers"),
    (["--parallel.pp=2", "--parallel.pp_layers=[3, 3, 2]"], "parallel.pp_layers.*2 entries"),
    (["--parallel.pp=2", "--parallel.pp_layers=[4, '4']"], "parallel.pp_layers.*list\\[int\\]"),
    (["--parallel.pp=2", "--parallel.pp_layers=[4, true]"], "parallel.pp_layers"),
    (["--parallel.vpp=2"], "parallel.vpp=2 needs parallel.pp > 1"),
    (["--parallel.pp=4", "--parallel.vpp=3"], "model.n_layers=8 is fewer than"),
])
def test_bad_layouts_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("gpt-tiny", ["--model.n_layers=8", *overrides])


def test_partition_validates_explicit_counts_too():
    for counts, match in (([4, 4], "sums to 8"), ([7, 0], "at least 1"), ([7], "1 entries")):
        with pytest.raises(ConfigError, match=match):
            partition_layers(7, 2, explicit=counts)
    assert partition_layers(7, 2, explicit=[2, 5]) == [2, 5]


def test_microbatches_per_step():
    cfg = load_config("gpt-tiny", ["--train.micro_batch_size=2", "--train.global_batch_size=16", "--parallel.pp=2"])
    assert microbatches_per_step(cfg, 1) == 8
    assert microbatches_per_step(cfg, dp=2) == 4
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        microbatches_per_step(cfg, dp=3)
    inter = load_config("gpt-tiny", ["--train.micro_batch_size=2", "--train.global_batch_size=6", "--parallel.pp=2",
                                     "--parallel.vpp=2", "--model.n_layers=8"])
    with pytest.raises(ConfigError, match="multiple of parallel.pp=2"):
        microbatches_per_step(inter, 1)


def test_reference_orders_follow_the_papers():
    """The helpers the real-run tests compare against: 1F1B's shape and the interleaved warm-up."""
    assert expected_1f1b(4, 6, 0) == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3), ("B", 0, 0), ("F", 0, 4),
                                      ("B", 0, 1), ("F", 0, 5), ("B", 0, 2), ("B", 0, 3), ("B", 0, 4), ("B", 0, 5)]
    for pp, m in ((2, 2), (4, 8), (4, 4), (3, 7)):
        for r in range(pp):
            order = expected_1f1b(pp, m, r)
            assert max_in_flight(order) == min(m, pp - r)
            assert sorted(order) == sorted([(k, r, i) for k in "FB" for i in range(m)])
    order = expected_interleaved(2, 2, 4, 0)
    assert order[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1)]  # (v−1)·p + 2(p−1) = 4 warm-up
    assert max_in_flight(order) == 5  # p·v·(1 + (p−1)/(p·v)) = 5 chunks: docs/formulas.md's interleaving factor


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (2, 1, 8), (4, 1, 4), (4, 1, 8), (2, 2, 4), (2, 2, 8), (4, 2, 4),
                                       (4, 2, 8), (4, 3, 12)])
def test_orders_reach_the_theoretical_bubble(pp, vpp, m):
    """With free messages the orders idle exactly (p − 1)/(v·m) of the ideal step (t_b = 2·t_f), the
    theory benchmarks/pipeline_bubble.py measures against."""
    orders = {r: expected_1f1b(pp, m, r) if vpp == 1 else expected_interleaved(pp, vpp, m, r) for r in range(pp)}
    assert simulate_bubble(orders, pp, vpp, m) == pytest.approx((pp - 1) / (vpp * m), abs=1e-9)


def _interleaved_order(pp: int, vpp: int, m: int, rank: int):
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(num_stages=pp * vpp, group_size=pp, group_rank=rank, stage_index=rank + k * pp)
              for k in range(vpp)]
    try:
        schedule = ScheduleInterleaved1F1B(stages, m)
    except (AttributeError, TypeError) as err:  # another torch version wants more of a stage
        pytest.skip(f"this torch builds interleaved schedules only from real stages ({err})")
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [(kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
            for a in schedule.pipeline_order[rank] if a is not None]


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 4), (2, 3, 6), (4, 3, 12), (3, 2, 6)])
def test_torch_interleaved_schedule_is_megatrons(pp, vpp, m):
    for rank in range(pp):
        assert _interleaved_order(pp, vpp, m, rank) == expected_interleaved(pp, vpp, m, rank)
