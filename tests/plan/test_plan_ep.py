"""The planner knows expert parallelism (parallel.ep): an MoE model's experts split over ep of the dp × cp ranks
(their parameters, gradients and optimizer states E/ep per rank, whole on each of their dp·cp/ep replicas),
the all-to-all buffers, and the all-to-all time; the search tries the ep sizes that divide dp × cp and the
experts, and a Mixtral-8x7B-shaped model on 64 H200 needs ep > 1 to fit without a pipeline."""

from __future__ import annotations

import pytest

from meshlm.core.config import load_config
from meshlm.plan.catalog import get_gpu
from meshlm.plan.cost import (
    Candidate,
    Cluster,
    Options,
    all_to_all_time,
    dispatch_bytes,
)
from meshlm.plan.search import candidates, ep_sizes, evaluate, search

# Mixtral 8x7B's shape: 32 layers of hidden 4096, GQA 32 / 8 heads, 8 SwiGLU experts of 14,336, top-2
MIXTRAL = ["--model.n_layers=32", "--model.hidden_size=4096", "--model.n_heads=32", "--model.n_kv_heads=8",
           "--model.moe_expert_hidden=14336", "--model.vocab_size=32000", "--model.seq_len=4096",
           "--train.global_batch_size=256"]
GIB = 2 ** 30


def _cfg(*extra):
    return load_config("gpt-moe-tiny", [*MIXTRAL, *extra])


def _cluster():
    return Cluster(get_gpu("h200"), 64, 8)


def _estimate(cand: Candidate):
    return evaluate(_cfg(), cand, _cluster(), 256, Options())


def test_expert_states_shrink_with_ep_and_ep_1_does_not_fit_without_a_pipeline():
    m = _cfg().model
    experts = 32 * 8 * 3 * 4096 * 14336  # every layer is an MoE layer: 45.1 B expert parameters
    # full recomputation: a layer of top-2 experts of 14,336 saves ~1.5 GiB at 4,096 tokens (core.memory
    # `_moe_terms`), 32 of them more than the 141 GB left beside the states
    one = _estimate(Candidate(1, 1, 64, zero=1, recompute="full"))
    eight = _estimate(Candidate(1, 1, 64, zero=1, ep=8, recompute="full"))
    assert not one.fits and eight.fits
    assert not _estimate(Candidate(1, 1, 64, zero=1, ep=8)).fits
    # the weights: 4 B per parameter, the experts 1/8 of them at ep 8
    assert one.memory["weights"] - eight.memory["weights"] == pytest.approx(4 * experts * 7 / 8, rel=1e-9)
    # ZeRO-1 shards the states over the 64 replicas at ep 1; at ep 8 the experts' Adam states are whole (8 B)
    dense = one.memory["optimizer states"] / 8 * 64 - experts
    assert eight.memory["optimizer states"] == pytest.approx(8 * dense / 64 + 8 * experts / 8, rel=1e-9)
    assert eight.memory["gradients"] == pytest.approx(4 * (dense + experts / 8), rel=1e-9)
    # one MoE layer's rows out and back, sent and received: 4 · b·s·k·h 16-bit elements
    assert eight.memory["EP all-to-all buffers (transient)"] == 4 * 1 * 4096 * 2 * 4096 * 2
    assert "EP all-to-all buffers (transient)" not in one.memory
    assert m.moe_experts == 8 and "--parallel.ep=8" in eight.candidate.overrides()


def test_all_to_all_time_is_four_exchanges_per_moe_layer_and_micro_batch():
    gpu = get_gpu("h200")
    eight, one = _estimate(Candidate(1, 1, 64, zero=1, ep=8)), _estimate(Candidate(1, 1, 64, zero=1))
    assert one.time["EP all-to-all"] == 0 and "EP expert gradient reduction" not in one.time
    msg = dispatch_bytes(_cfg().model, 1, 4096, 2)
    assert msg == 4096 * 2 * 4096 * 2
    # 32 layers × 4 micro-batches × (dispatch + combine, forward and backward), over NVLink (8 ranks a node)
    want = 32 * 4 * 4 * all_to_all_time(msg, 8, gpu.intra_gbps, gpu.intra_latency_us, 0.75)
    assert eight.time["EP all-to-all"] == pytest.approx(want, rel=1e-9)
    # the experts' gradients are reduced over their 64 / 8 replicas only
    assert eight.time["EP expert gradient reduction"] > 0
    assert all_to_all_time(msg, 1, 1.0, 1.0, 1.0) == 0


def test_the_search_picks_ep_where_memory_needs_it():
    cfg, cluster = _cfg(), _cluster()
    space = candidates(cfg, 64, 8, 256, {"tp": 1, "pp": 1})
    assert {c.ep for c in space} == {1, 2, 4, 8}
    result = search(cfg, cluster, 256, Options(), space=space)
    assert result.best is not None and result.best.candidate.ep > 1
    # without a pipeline, whole weights (ZeRO 0-2) fit only with the experts split: 187 GB of fp32 weights
    assert not any(e.candidate.ep == 1 and e.candidate.zero < 3 for e in result.ranked)
    assert any(e.candidate.ep == 1 and e.candidate.zero < 3 for e in result.too_big)
    # ZeRO-3 at ep 1 fits too, but gathers every layer's experts twice per micro-batch: slower than ep
    zero3 = [e for e in result.ranked if e.candidate.zero == 3]
    assert zero3 and zero3[0].tokens_per_s < result.best.tokens_per_s
    assert any("parallel.zero=3 with parallel.ep" in why for _, why in result.rejected)  # refused, as training does


def test_ep_sizes_divide_the_replicas_and_the_experts():
    assert ep_sizes(_cfg(), 12) == [1, 2, 4]
    assert ep_sizes(_cfg(), 64) == [1, 2, 4, 8]
    assert ep_sizes(load_config("llama-tiny", []), 64) == [1]  # a dense model: no ep


def test_plan_takes_layout_ep(capsys):
    from meshlm.cli import main

    rc = main(["plan", "--config", "gpt-moe-tiny", *MIXTRAL, "--gpus", "64", "--gpus-per-node", "8", "--gpu", "h200",
               "--layout", "tp=1,pp=1,ep=8,zero=1,mbs=1,recompute=full"])
    out = capsys.readouterr().out
    assert rc == 0 and "--parallel.ep=8" in out, out
