"""Packed documents (`data.document_mask`) under every layout: the same numbers as one process.

Rows of the harness's small models (dp_harness.py: 2 layers, width 32, 16 tokens, float64, clipped AdamW,
global batch 8 of micro-batch 1) hold several documents (end-of-document id 100, the vocabulary's last),
and every forward gets their positions and segments (`ModelSpec.document_inputs`), as the trainer passes
them. One forked gloo world of 2 processes trains tp2 + SP (gpt-tiny: learned positions; llama-tiny: RoPE,
GQA; and llama with selective recomputation), pp2 (both; gpt with full recomputation) and dp2 with ZeRO-1
for 2 steps each; losses, gradient norms, weights and then an evaluation loss (the pipeline's forward-only
path) are within the harness's TOL of the single-process run with documents. In one process, selective and full recomputation with documents equal none, and the
documents do change the numbers (the runs above would not notice a layout that dropped them otherwise).
"""

from __future__ import annotations

import dp_harness as H
import numpy as np
import pytest
import torch
from parallel_world import run_world

from meshlm.data.dataset import BatchLoader
from meshlm.families.registry import get_spec

EOD, STEPS = 100, 2
# name: (model, tp, pp, dp, zero, parallel keys, train keys)
LAYOUTS = {
    "gpt_tp2_sp": ("gpt", 2, 1, 1, 0, {"sp": True}, {}),
    "llama_tp2_sp": ("llama", 2, 1, 1, 0, {"sp": True}, {}),
    "llama_tp2_sp_selective": ("llama", 2, 1, 1, 0, {"sp": True}, {"recompute": "selective"}),
    "gpt_pp2": ("gpt", 1, 2, 1, 0, {}, {}),
    "llama_pp2": ("llama", 1, 2, 1, 0, {}, {}),
    "gpt_pp2_full": ("gpt", 1, 2, 1, 0, {}, {"recompute": "full"}),
    "gpt_dp2_zero1": ("gpt", 1, 1, 2, 1, {}, {}),
}


def packed_rows(cfg) -> list[np.ndarray]:
    """The harness's random rows with 1-3 end-of-document tokens each, at random places."""
    g = np.random.default_rng(11)
    rows = []
    for _ in range(H.N_SAMPLES):
        row = g.integers(0, EOD, cfg.model.seq_len + 1)
        row[g.choice(cfg.model.seq_len, size=int(g.integers(1, 4)), replace=False)] = EOD
        rows.append(row)
    return rows


def build(cfg, dims):
    run = H.build_run(cfg, dims)
    run.loader = BatchLoader(packed_rows(cfg), cfg.train.micro_batch_size, H.SEED, dp_rank=run.dims.dp_rank,
                             dp_size=run.dims.dp)
    return run


def step(run, documents: bool = True) -> float:
    """dp_harness.step with the batch's positions and segments given to the model (or the pipeline)."""
    kw = (lambda x: get_spec(run.cfg.model.family).document_inputs(x, EOD)) if documents else (lambda x: {})
    if run.pipe is not None:
        batches = [run.loader.next() for _ in range(run.m)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        total = run.pipe.train_step(x, y, **kw(x))
    else:
        total = torch.zeros(())
        for i in range(run.m):
            x, y = run.loader.next()
            run.sync.set_last_microbatch(i == run.m - 1)
            loss = run.loss_fn(run.model(x, **kw(x)), y) / run.m
            loss.backward()
            total += loss.detach()
    loss = float(run.sync.average_loss(total))
    run.sync.finish()
    run.norms.append(float(run.sync.clip_grad_norm_(H.CLIP)))
    run.opt.step()
    run.sync.after_step()
    run.sync.zero_grad(run.opt)
    run.losses.append(loss)
    return loss


@torch.no_grad()
def eval_loss(run) -> float:
    """The evaluation's loss of two packed rows with their documents (the pipeline's forward-only path)."""
    rows = torch.from_numpy(np.stack(packed_rows(run.cfg)[:2]))
    x, y = rows[:, :-1], rows[:, 1:]
    kw = get_spec(run.cfg.model.family).document_inputs(x, EOD)
    if run.pipe is not None:
        return float(run.pipe.eval_loss(x, y, **kw))
    run.model.eval()
    loss = float(run.loss_fn(run.model(x, **kw), y))
    run.model.train()
    return loss


def reference(model: str, train: dict | None = None, documents: bool = True) -> dict:
    run = build(H.config(model, train=train), None)
    states = {}
    for n in range(1, STEPS + 1):
        step(run, documents)
        states[n] = H.full_state(run)
    return {"losses": run.losses, "norms": run.norms, "states": states, "eval": eval_loss(run)}


def _world(rank: int, world_size: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (model, tp, pp, dp, zero, parallel, train) in LAYOUTS.items():
            cfg = H.config(model, tp, pp, dp, zero, train=train, **parallel)
            run = build(cfg, H.dims_for(tp, pp, dp))
            for _ in range(STEPS):
                step(run)
            out[name] = run.losses, run.norms, H.full_state(run), eval_loss(run)
    return out


@pytest.fixture(scope="module")
def references():
    with H.float64(), H.one_thread():
        return {model: reference(model) for model in ("gpt", "llama")}


def test_layouts_with_documents_equal_one_process(references, tmp_path):
    results = run_world(_world, 2, tmp_path, deadline_s=240)
    for name, (model, *_rest) in LAYOUTS.items():
        ref = references[model]
        for rank, result in enumerate(results):
            losses, norms, state, evaluated = result[name]
            want = ref["states"][STEPS]
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])) <= H.TOL, (name, rank, losses)
            assert max(abs(a - b) / abs(b) for a, b in zip(norms, ref["norms"])) <= H.TOL, (name, rank, norms)
            assert state and max(float((v - want[k]).abs().max()) for k, v in state.items()) <= H.TOL, (name, rank)
            assert abs(evaluated - ref["eval"]) <= H.TOL * abs(ref["eval"]), (name, rank, evaluated, ref["eval"])


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_with_documents_equals_none(references, mode):
    with H.float64(), H.one_thread():
        got = reference("llama", {"recompute": mode})
    ref = references["llama"]
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])) <= H.TOL
    assert max(abs(a - b) / abs(b) for a, b in zip(got["norms"], ref["norms"])) <= H.TOL
    want = ref["states"][STEPS]
    assert max(float((v - want[k]).abs().max()) for k, v in got["states"][STEPS].items()) <= H.TOL


def test_documents_change_the_reference(references):
    """The negative control of the checks above: without positions and segments the same rows train
    differently (so a layout that lost them would fail)."""
    with H.float64(), H.one_thread():
        for model in ("gpt", "llama"):
            plain = reference(model, documents=False)
            assert abs(plain["losses"][0] - references[model]["losses"][0]) > 1e-4
