"""gpt-oss's layer (issue 46): q/k/v/o biases, sinks, alternating windows, a router with a bias and experts with
biases and the clamped SwiGLU (`model.moe_bias`, `model.moe_activation='swiglu_clamped'`) under tp2 + SP, tp2 with
full recompute, dp2 × ep2 (the expert biases sliced with their experts, `parallel/expert.py`), dp2 with ZeRO-1 and
ZeRO-3, cp2 and pp2 equal one process. The clamp limit is 0.05, so at these small weights the clamps engage.

Float64 (dp_harness), aux loss on, 2 clipped AdamW steps: loss, gradient norm and final weights (the experts
gathered over ep) within dp_harness.TOL of one process.
"""

from __future__ import annotations

import dp_harness as H
from parallel_world import run_world

from meshlm.models.moe import set_aux_grad_scale
from meshlm.parallel.mesh import ParallelDims

STEPS = 2
H.MODELS.setdefault("gpt_oss_exact", {**H.MODELS["llama"], "bias": True, "sliding_window": 5, "window_pattern": 2,
                                      "attention_sinks": True, "moe_experts": 4, "moe_top_k": 2,
                                      "moe_expert_hidden": 24, "moe_bias": True, "moe_activation": "swiglu_clamped",
                                      "moe_swiglu_limit": 0.05, "moe_aux_loss": 0.05})
# name: (tp, pp, dp, cp, ep, sp, zero, recompute), world 2
LAYOUTS = {"tp2_sp": (2, 1, 1, 1, 1, True, 0, "none"), "tp2_full": (2, 1, 1, 1, 1, False, 0, "full"),
           "dp2_ep2": (1, 1, 2, 1, 2, False, 0, "none"), "dp2_zero1": (1, 1, 2, 1, 1, False, 1, "none"),
           "dp2_zero3": (1, 1, 2, 1, 1, False, 3, "none"), "cp2": (1, 1, 1, 2, 1, False, 0, "none"),
           "pp2": (1, 2, 1, 1, 1, False, 0, "none")}
_REF: dict = {}  # the one-process run, computed before the world is forked


def _train(cfg, dims: ParallelDims | None):
    run = H.build_run(cfg, dims)
    set_aux_grad_scale(run.model, 1.0 / run.m)
    for _ in range(STEPS):
        H.step(run)
    return run


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (tp, pp, dp, cp, ep, sp, zero, recompute) in LAYOUTS.items():
            cfg = H.config("gpt_oss_exact", tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sp=sp, zero=zero,
                           train={"recompute": recompute})
            run = _train(cfg, ParallelDims.build(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, timeout_s=60))
            got = H.compare(_REF, run)
            out[name] = (got["loss"], got["grad_norm"], got["weights"])
    return out


def test_gpt_oss_layer_under_tp_sp_ep_zero_cp_pp_recompute_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        run = _train(H.config("gpt_oss_exact"), None)
        _REF.update({"losses": run.losses, "norms": run.norms, "states": {STEPS: H.full_state(run)}})
    ref = _REF["states"][STEPS]
    for name in ("layers.0.mlp.router.bias", "layers.0.mlp.experts.fc_bias", "layers.0.mlp.experts.proj_bias",
                 "layers.0.attn.sinks"):
        assert float(ref[name].abs().max()) > 1e-4, name  # every new tensor trains
    seen = {}
    for result in run_world(_world, 2, tmp_path / "world2"):
        for name, got in result.items():
            seen[name] = tuple(map(max, seen.get(name, (0.0,) * 3), got))  # (loss, norm, weights)
    assert sorted(seen) == sorted(LAYOUTS)
    bad = {name: worst for name, worst in seen.items() if max(worst) >= H.TOL}
    assert not bad, bad
