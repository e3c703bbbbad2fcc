"""The planner's validity and memory against the real thing, in one spawned world of 4 gloo processes:

* every layout of a grid that `plan.search.check` calls valid builds under `build_model` / `parallelize`
  (config validation, then `plan_layout`, then the transforms), and every one it rejects fails there with
  the same `ConfigError` message;
* the predicted activation bytes and parameters per rank of small tensor-parallel layouts are within 10% of
  what `meshlm bench memory` (`bench_memory`) measures on rank 0.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re

import pytest

from meshlm.core.config import ConfigError, build
from meshlm.families.registry import get_spec
from meshlm.plan.catalog import get_gpu
from meshlm.plan.cost import Candidate, Cluster, Options
from meshlm.plan.search import candidates, check, evaluate
from tests.conftest import ROOT

MODEL = {"n_layers": 4, "hidden_size": 32, "n_heads": 4, "seq_len": 32, "vocab_size": 1024, "dropout": 0.0}
WORLD = 4
MEMORY_LAYOUTS = [Candidate(2, 1, 2, sp=True, micro_batch_size=2, recompute="selective"),
                  Candidate(4, 1, 1, sp=False, micro_batch_size=2, recompute="none"),
                  Candidate(2, 1, 2, sp=False, micro_batch_size=2, recompute="full")]


def _base(**train):
    return build({"model": MODEL, "train": {"micro_batch_size": 1, "global_batch_size": 4, "precision": "fp32",
                                            "device": "cpu", **train}, "parallel": {"timeout_s": 60}})


def _grid() -> list[Candidate]:
    """Every 7th candidate of the search space for 4 processes: valid and rejected layouts of every kind."""
    space = candidates(_base(), WORLD, WORLD, 4)
    extra = [Candidate(4, 1, 1, micro_batch_size=8), Candidate(1, 2, 2, vpp=2), Candidate(2, 2, 1, vpp=4, sp=True),
             Candidate(4, 1, 1, zero=3), Candidate(1, 4, 1, recompute="full", recompute_num_layers=2)]
    return space[::7] + extra


def _verdict(fn) -> str:
    try:
        fn()
    except ConfigError as err:
        return str(err)
    return "ok"


def _world(grid: list[Candidate], rank: int, world: int, out_dir: str) -> dict:
    import torch

    from meshlm.parallel import ParallelDims, build_model
    from meshlm.plan.bench import bench_memory

    torch.manual_seed(0)
    base = _base()
    built = []
    for cand in grid:
        def build_it(cand=cand):
            run = build({**{k: dict(v) for k, v in base.to_dict().items()},
                         "parallel": {**base.to_dict()["parallel"], "tp": cand.tp, "pp": cand.pp, "dp": cand.dp,
                                      "vpp": cand.vpp, "sp": cand.sp, "zero": cand.zero},
                         "train": {**base.to_dict()["train"], "micro_batch_size": cand.micro_batch_size,
                                   "recompute": cand.recompute,
                                   "recompute_method": "block" if cand.recompute_num_layers else "uniform",
                                   "recompute_num_layers": cand.recompute_num_layers}})
            dims = ParallelDims.build(cand.tp, cand.pp, cand.dp, timeout_s=60, device=torch.device("cpu"))
            build_model(run, dims, spec=get_spec(run.model.family))
        built.append(_verdict(build_it))
    reports = []
    for cand in MEMORY_LAYOUTS:
        run = cand.apply(_base(micro_batch_size=cand.micro_batch_size))
        run = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, dp=0))  # bench: dp from the world
        reports.append(bench_memory(run))
    return {"built": built, "reports": reports}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    grid = _grid()
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "tests" / "parallel"))  # the spawned workers import it by name too
        run_world = importlib.import_module("parallel_world").run_world
        results = run_world(functools.partial(_world, grid), WORLD, tmp_path_factory.mktemp("plan-world"),
                            deadline_s=240)
    return grid, results[0]


def test_what_the_search_calls_valid_builds_and_what_it_rejects_fails_with_the_same_reason(world):
    grid, result = world
    predicted = [_verdict(lambda c=c: check(_base(), c)) for c in grid]
    assert "ok" in predicted and len(set(predicted)) > 3, "the grid should hold valid layouts and several rejections"
    for cand, want, got in zip(grid, predicted, result["built"]):
        assert got == want, f"{cand.label()}: the search says {want!r}, parallelize {got!r}"


def test_predicted_memory_of_small_layouts_is_within_10_percent_of_bench_memory(world):
    _, result = world
    cluster = Cluster(get_gpu("a100-80gb"), WORLD, WORLD)
    opts = Options(precision="fp32", device_type="cpu", fused_loss=True)
    for cand, text in zip(MEMORY_LAYOUTS, result["reports"]):
        cfg = _base(micro_batch_size=cand.micro_batch_size)
        est = evaluate(cfg, cand, cluster, 4, opts)
        measured = int(re.search(r"^\| all \| ([\d,]+) \|", text, re.MULTILINE).group(1).replace(",", ""))
        params = int(re.search(r"model states on this rank: ([\d,]+) parameters", text).group(1).replace(",", ""))
        # one micro-batch's activations in the layers (pp = 1: one in flight), and the weights (fp32: 4 B each)
        assert est.memory["activations"] == pytest.approx(measured, rel=0.10), (cand.label(), text)
        assert est.memory["weights"] / 4 == pytest.approx(params, rel=0.10), (cand.label(), text)


def test_compiled_recompute_of_the_tp_dropout_stream_is_refused_by_the_search_as_by_parallelize():
    from meshlm.core.layout import check_compiled_recompute
    from meshlm.parallel.recompute import apply_recompute  # noqa: F401 (it asks plan.layout the same question)

    cfg = build({"model": {**MODEL, "dropout": 0.1}, "train": {"micro_batch_size": 1, "global_batch_size": 4, "compile": True}})
    with pytest.raises(ConfigError) as search_err:
        check(cfg, Candidate(2, 1, 2, recompute="selective"))
    with pytest.raises(ConfigError) as rule_err:
        check_compiled_recompute(Candidate(2, 1, 2, recompute="selective").apply(cfg), True)
    assert str(search_err.value) == str(rule_err.value) and "train.compile=true" in str(search_err.value)
    check(cfg, Candidate(1, 1, 4, recompute="selective"))  # tp = 1: no TP stream to replay
