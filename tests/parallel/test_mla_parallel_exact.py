"""Multi-head latent attention (`model.attention='mla'`, models/mla.py) under tp, sp, pp and dp equal one process
(issue 46, item 3).

Under tp the heads are split (`q_up`/`kv_up` column-parallel, `proj` row-parallel) while the down projections
and the latent norms are computed whole on every rank; their gradients are whole because what follows them is
column-parallel (its backward sums the input gradient over tp), except the rope key all heads share, which each
rank uses for its heads only: its gradient is summed over tp (`rope_key_region`). Under SP the tokens are gathered
once before the replicated projections. Checked in float64 (dp_harness), 2 clipped AdamW steps, with q
compression and values narrower than queries/keys (the padded cache width): tp2 (+SP, selective recompute),
tp2 with full recompute, pp2, dp2 with ZeRO-1 and ZeRO-3, and a tp2 + SP checkpoint resumed under pp2: loss,
gradient norm and final weights within dp_harness.TOL of one process.
"""

from __future__ import annotations

import dp_harness as H
from parallel_world import run_world

from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.parallel.mesh import ParallelDims

STEPS = 2
H.MODELS.setdefault("mla_exact", {**{k: v for k, v in H.MODELS["llama"].items() if k != "n_kv_heads"},
                                  "attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                                  "qk_rope_head_dim": 4, "v_head_dim": 6})
# name: (tp, pp, dp, sp, zero, recompute)
LAYOUTS = {"tp2_sp_selective": (2, 1, 1, True, 0, "selective"), "tp2_full": (2, 1, 1, False, 0, "full"),
           "pp2": (1, 2, 1, False, 0, "none"), "dp2_zero1": (1, 1, 2, False, 1, "none"),
           "dp2_zero3": (1, 1, 2, False, 3, "none")}
_REF: dict = {}  # the one-process run, computed before the world is forked


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (tp, pp, dp, sp, zero, recompute) in LAYOUTS.items():
            cfg = H.config("mla_exact", tp=tp, pp=pp, dp=dp, zero=zero, sp=sp, train={"recompute": recompute})
            run = H.train(cfg, ParallelDims.build(tp=tp, pp=pp, dp=dp, timeout_s=60), STEPS)
            got = H.compare(_REF, run)
            out[name] = (got["loss"], got["grad_norm"], got["weights"])
        # a layout change: one step under tp2 + SP, saved (layout-free pieces), resumed under pp2 for the second
        first = H.train(H.config("mla_exact", tp=2, sp=True), ParallelDims.build(tp=2, timeout_s=60), 1)
        H.save(first, f"{out_dir}/tp2_sp", {})
        run = H.resume(H.config("mla_exact", pp=2), ParallelDims.build(pp=2, timeout_s=60),
                       resolve_checkpoint(f"{out_dir}/tp2_sp"))
        H.step(run)
        got = H.compare(_REF, run)
        out["tp2_sp_saved_then_pp2"] = (got["loss"], got["grad_norm"], got["weights"])
    return out


def test_mla_under_tp_sp_pp_dp_zero_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        _REF.update(H.reference("mla_exact", STEPS))
    ref = _REF["states"][STEPS]
    assert float((ref["layers.0.attn.kv_norm.weight"] - 1).abs().max()) > 1e-4  # the latent path trains
    seen = {}
    for result in run_world(_world, 2, tmp_path / "world2"):
        for name, got in result.items():
            seen[name] = tuple(map(max, seen.get(name, (0.0,) * 3), got))  # (loss, norm, weights)
    assert sorted(seen) == sorted([*LAYOUTS, "tp2_sp_saved_then_pp2"])
    bad = {name: worst for name, worst in seen.items() if max(worst) >= H.TOL}
    assert not bad, bad
