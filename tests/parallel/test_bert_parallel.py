"""BERT under every parallel layout trains like one process (issue: BERT, acceptance).

The dp_harness runs (float64, dropout off, 3 clipped AdamW steps of a global batch of 8 rows, 1 per
micro-batch) on a small BERT (4 layers of width 32, 16 tokens, vocabulary 101) pretraining on rows in the
data pipeline's layout: two segments, 0-6 padding tokens (so the padding mask matters), a third of the
real tokens predicted, a random sentence-order label. Each layout's per-step losses and gradient norms
must be within 1e-9 (relative) of the single-process run, its final weights within 1e-9 (dp_harness.TOL).
Covered: TP=2 and 4 with and without SP (vocab-parallel MLM decoder and loss, the pooler's sequence
gather), PP=2 and interleaved PP=2×vpp2 (every stage gets the padding mask), DP=2 with ZeRO 1/2/3,
tp2 × pp2 with SP, selective and full recomputation under TP, and the LAMB optimizer under tp2 and
tp2 × pp2 (its per-parameter trust ratios from whole-parameter norms: shard squares summed over tp).
The single-process references are computed once, by the test process, and handed to every rank.
"""

from __future__ import annotations

import functools

import dp_harness as H
import pytest
from parallel_world import run_world

STEPS = 3

LAYOUTS = {
    2: {"tp2": (2, 1, 1, 0, {}, {}), "tp2_sp": (2, 1, 1, 0, {"sp": True}, {}), "pp2": (1, 2, 1, 0, {}, {}),
        "dp2_zero1": (1, 1, 2, 1, {}, {}), "dp2_zero3": (1, 1, 2, 3, {}, {}),
        "tp2_sp_selective": (2, 1, 1, 0, {"sp": True}, {"recompute": "selective"}),
        "tp2_full": (2, 1, 1, 0, {}, {"recompute": "full"}), "tp2_lamb": (2, 1, 1, 0, {}, {}, "lamb")},
    4: {"tp4": (4, 1, 1, 0, {}, {}), "tp4_sp": (4, 1, 1, 0, {"sp": True}, {}),
        "tp2_sp_pp2": (2, 2, 1, 0, {"sp": True}, {}), "pp2_vpp2_dp2_zero2": (1, 2, 2, 2, {"vpp": 2}, {}),
        "tp2_sp_pp2_lamb": (2, 2, 1, 0, {"sp": True}, {}, "lamb")},
}

def _world_fn(refs: dict, rank: int, world: int, out_dir: str) -> dict:
    with H.float64():
        out = {}
        for name in LAYOUTS[world]:
            tp, pp, dp, zero, parallel, train, *optim = LAYOUTS[world][name]
            optim = optim[0] if optim else "adamw"
            cfg = H.config("bert", tp=tp, pp=pp, dp=dp, zero=zero, train=train, optim=optim, **parallel)
            run = H.train(cfg, H.dims_for(tp, pp, dp), STEPS)
            out[name] = H.compare(refs[optim], run)
        return out

@pytest.fixture(scope="module")
def references() -> dict:
    with H.float64(), H.one_thread():
        return {optim: H.reference("bert", STEPS, optim) for optim in ("adamw", "lamb")}


@pytest.mark.parametrize("world", [2, 4])
def test_bert_layouts_match_one_process(world, references, tmp_path):
    results = run_world(functools.partial(_world_fn, references), world, tmp_path, deadline_s=300)
    for rank, per_case in enumerate(results):
        for name, diff in per_case.items():
            assert diff["loss"] < H.TOL and diff["grad_norm"] < H.TOL, (name, rank, diff)
            assert diff["weights"] < H.TOL, (name, rank, diff["weights"])
    # every parameter of the model is held by some rank in every layout
    ref_keys = set(references["adamw"]["states"][1])
    for name in LAYOUTS[world]:
        held = set().union(*(set(r[name]["keys"]) for r in results))
        assert held == ref_keys, (name, ref_keys ^ held)
    # the runs learned something: the loss moved
    losses = results[0][next(iter(LAYOUTS[world]))]["losses"]
    assert losses[-1] < losses[0]
