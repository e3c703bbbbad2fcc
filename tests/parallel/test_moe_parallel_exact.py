"""MoE router statistics under context and sequence parallelism equal one process's (meshlm issue 48).

The load-balancing loss E · Σ_i f_i · P_i is not linear in the token set: under cp (and tp + SP) each rank
formed it from the expert load f_i of its own share of the rows, so the gradients (and, after one update,
the losses) differed from one process: 1.6e-5 in the loss at step 2 under cp2 × ep2, 4e-4 in the norm at
step 1 under tp2 + SP. And under SP every tp rank's z-loss gradient was a whole mean over its tokens, summed
over tp: the router's z-loss gradient tp times one process's. Now the load is counted over the ranks holding
the rest of the rows (`MoE.token_groups`) and each SP rank's aux and z losses weigh 1/tp.

Checked in float64 (dp_harness), aux and z losses on, 2 clipped AdamW steps: cp2 × ep2, cp2 with the sigmoid
router (its selection bias updated from the step's global load after each step), tp2 + SP, cp2 × tp2 + SP ×
ep2 (world 4), and tp2 + SP × pp2 × dp2 × ep2 (world 8): loss, gradient norm and final weights (the experts
gathered over ep) within dp_harness.TOL of one process, and the router biases equal.
"""

from __future__ import annotations

import dp_harness as H
import torch
from parallel_world import run_world

from meshlm.models.moe import moe_layers, set_aux_grad_scale, update_router_bias
from meshlm.parallel.mesh import ParallelDims
from meshlm.train.metrics import moe_groups

STEPS = 2
MOE = {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16, "vocab_size": 101,
       "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
       "moe_experts": 4, "moe_top_k": 2, "moe_expert_hidden": 24, "moe_shared_experts": 1, "moe_shared_gate": True,
       "moe_aux_loss": 0.05, "moe_z_loss": 0.01}
H.MODELS.setdefault("moe_exact", MOE)
H.MODELS.setdefault("moe_exact_sigmoid", {**MOE, "moe_router": "sigmoid", "moe_bias_rate": 0.01})
# name: (model, tp, pp, dp, cp, ep, sp), by world size
LAYOUTS = {
    2: {"cp2_ep2": ("moe_exact", 1, 1, 1, 2, 2, False), "cp2_sigmoid": ("moe_exact_sigmoid", 1, 1, 1, 2, 1, False),
        "tp2_sp": ("moe_exact", 2, 1, 1, 1, 1, True)},
    4: {"cp2_tp2_sp_ep2": ("moe_exact", 2, 1, 1, 2, 2, True)},
    8: {"tp2_sp_pp2_dp2_ep2": ("moe_exact", 2, 2, 2, 1, 2, True)},
}
_REFS: dict = {}  # model → the one-process run, computed before the worlds are forked


def _train(cfg, dims: ParallelDims | None, sp: bool = False):
    """dp_harness's steps as the trainer takes them for MoE: aux-loss gradients scaled by 1 / micro-batches,
    the sigmoid routers' biases updated from the global load after each optimizer step."""
    run = H.build_run(cfg, dims)
    set_aux_grad_scale(run.model, 1.0 / run.m)
    groups = moe_groups(dims, sp) if dims is not None else []
    for _ in range(STEPS):
        H.step(run)
        update_router_bias(run.model, groups)
    return run


def _biases(run) -> dict[str, torch.Tensor]:
    return {name: m.router.score_bias.clone() for name, m in moe_layers(run.model) if m.router.score_bias is not None}


def _reference(model: str) -> dict:
    run = _train(H.config(model), None)
    return {"losses": run.losses, "norms": run.norms, "states": {STEPS: H.full_state(run)}, "biases": _biases(run)}


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (model, tp, pp, dp, cp, ep, sp) in LAYOUTS[world].items():
            cfg = H.config(model, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, sp=sp)
            dims = ParallelDims.build(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, timeout_s=60)
            run = _train(cfg, dims, sp)
            got = H.compare(_REFS[model], run)
            want = _REFS[model]["biases"]
            got["bias"] = max([float((b - want[n]).abs().max()) for n, b in _biases(run).items()], default=0.0)
            out[name] = (got["loss"], got["grad_norm"], got["weights"], got["bias"])
    return out


def test_moe_under_cp_sp_pp_ep_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        _REFS.update({m: _reference(m) for m in ("moe_exact", "moe_exact_sigmoid")})
    assert max(float(b.abs().max()) for b in _REFS["moe_exact_sigmoid"]["biases"].values()) > 0  # biases moved
    seen = {}
    for world in LAYOUTS:
        for result in run_world(_world, world, tmp_path / f"world{world}"):
            for name, got in result.items():
                seen[name] = tuple(map(max, seen.get(name, (0.0,) * 4), got))  # (loss, norm, weights, bias)
    assert sorted(seen) == sorted(n for layouts in LAYOUTS.values() for n in layouts)
    bad = {name: worst for name, worst in seen.items() if max(worst) >= H.TOL}
    assert not bad, bad
