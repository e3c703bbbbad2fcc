"""Multi-token prediction (`model.mtp_depth`, models/mtp.py) under tp, sp, pp and dp equal one process (issue 46,
item 4).

The model computes its own loss from the final stream (`GPT.head_loss`: the main cross-entropy, and in its gradient
λ/D Σ CE_k), at every tp (on vocab-split logits under tp) and as the last pipeline stage's loss. Under tp the MTP
blocks are split like the layers, the norms and the 2h → h merge replicated (their gradients summed over tp under
SP); under pp the modules live on the last stage, which keeps a copy of the shared embedding whose gradient is
summed with the first stage's (as a tied embedding's); recomputation wraps the module blocks as the layers. Checked in float64 (dp_harness), depth 2 (the modules
chained), untied embeddings, 2 clipped AdamW steps: tp2 + SP with selective recompute, tp2 with full recompute,
pp2, dp2 with ZeRO-1 and ZeRO-3, and a tp2 + SP checkpoint resumed under pp2: loss, gradient norm and final
weights (the MTP modules' included) within dp_harness.TOL of one process (also pp2 with a tied head, depth 1).
"""

from __future__ import annotations

import dp_harness as H
import torch
from parallel_world import run_world

from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.parallel.mesh import ParallelDims
from meshlm.train.metrics import mtp_groups, mtp_metrics

STEPS = 2
H.MODELS.setdefault("mtp_exact", {**H.MODELS["llama"], "mtp_depth": 2, "mtp_loss_weight": 0.5})
H.MODELS.setdefault("mtp_tied", {**H.MODELS["llama"], "mtp_depth": 1, "tie_embeddings": True})
# name: (tp, pp, dp, sp, zero, recompute)
LAYOUTS = {"tp2_sp_selective": (2, 1, 1, True, 0, "selective"), "tp2_full": (2, 1, 1, False, 0, "full"),
           "pp2": (1, 2, 1, False, 0, "none"), "dp2_zero1": (1, 1, 2, False, 1, "none"),
           "dp2_zero3": (1, 1, 2, False, 3, "none")}
_REF: dict = {}  # the one-process runs, computed before the world is forked


def _step(run: H.Run) -> float:
    """dp_harness.step with the model's own loss (`forward(x, targets=y)`), as the trainer runs an MTP model."""
    if run.pipe is not None:
        return H.step(run)
    total = torch.zeros(())
    for i in range(run.m):
        x, y = run.loader.next()
        run.sync.set_last_microbatch(i == run.m - 1)
        loss = run.model(x, targets=y) / run.m
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


def _train(cfg, dims, steps: int) -> H.Run:
    run = H.build_run(cfg, dims)
    for _ in range(steps):
        _step(run)
    return run


def _reference(model: str) -> dict:
    run = H.build_run(H.config(model), None)
    states = {}
    for n in range(1, STEPS + 1):
        _step(run)
        states[n] = H.full_state(run)
    return {"losses": run.losses, "norms": run.norms, "states": states,
            "mtp": mtp_metrics(run.model, run.cfg.model.mtp_depth)}


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (tp, pp, dp, sp, zero, recompute) in LAYOUTS.items():
            cfg = H.config("mtp_exact", tp=tp, pp=pp, dp=dp, zero=zero, sp=sp, train={"recompute": recompute})
            run = _train(cfg, ParallelDims.build(tp=tp, pp=pp, dp=dp, timeout_s=60), STEPS)
            got = H.compare(_REF["mtp_exact"], run)
            # the logged MTP losses: every micro-batch's, summed over dp and pp, as one process logs them
            logged = mtp_metrics(run.model, 2, mtp_groups(run.dims))
            metric = max(abs(logged[k] - v) / v for k, v in _REF["mtp_exact"]["mtp"].items())
            out[name] = (got["loss"], got["grad_norm"], got["weights"], metric)
        # a tied embedding and head under pp: the last stage's copy serves the head and the module
        run = _train(H.config("mtp_tied", pp=2), ParallelDims.build(pp=2, timeout_s=60), STEPS)
        got = H.compare(_REF["mtp_tied"], run)
        out["pp2_tied"] = (got["loss"], got["grad_norm"], got["weights"], 0.0)
        # a layout change: one step under tp2 + SP, saved (layout-free pieces), resumed under pp2 for the second
        first = _train(H.config("mtp_exact", tp=2, sp=True), ParallelDims.build(tp=2, timeout_s=60), 1)
        H.save(first, f"{out_dir}/tp2_sp", {})
        run = H.resume(H.config("mtp_exact", pp=2), ParallelDims.build(pp=2, timeout_s=60),
                       resolve_checkpoint(f"{out_dir}/tp2_sp"))
        _step(run)
        got = H.compare(_REF["mtp_exact"], run)
        out["tp2_sp_saved_then_pp2"] = (got["loss"], got["grad_norm"], got["weights"], 0.0)
    return out


def test_mtp_under_tp_sp_pp_dp_zero_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        _REF.update({model: _reference(model) for model in ("mtp_exact", "mtp_tied")})
    ref, start = _REF["mtp_exact"]["states"][STEPS], H.build_run(H.config("mtp_exact"), None).model.state_dict()
    for name in ("mtp.1.merge.weight", "mtp.1.block.attn.qkv.weight", "mtp.0.enorm.weight"):  # the modules train
        assert float((ref[name] - start[name]).abs().max()) > 1e-4, name
    seen = {}
    for result in run_world(_world, 2, tmp_path / "world2"):
        for name, got in result.items():
            seen[name] = tuple(map(max, seen.get(name, (0.0,) * 4), got))  # (loss, norm, weights, mtp metric)
    assert sorted(seen) == sorted([*LAYOUTS, "pp2_tied", "tp2_sp_saved_then_pp2"])
    bad = {name: worst for name, worst in seen.items() if max(worst[:3]) >= H.TOL or worst[3] > 1e-6}
    assert not bad, bad
