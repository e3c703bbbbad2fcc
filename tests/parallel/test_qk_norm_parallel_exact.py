"""Qwen3's per-head q/k norms (`model.qk_norm`) with wide heads (`model.head_size`) under every layout equal one
process (issue 46).

The norms' weights are whole on every tp rank while the heads they scale are split, so each rank's gradient
holds only its heads' share and must be summed over tp (`parallel.styles`' head-parallel attention marks them);
with one KV head and tp 2 both ranks hold that head, and k_norm's two partial gradients add up as its K rows' do.
Checked in float64 (dp_harness), 2 clipped AdamW steps, one KV head of 16 over a width of 32 with 4 query heads:
tp2 (+SP, selective recompute), tp2 with full recompute, pp2, dp2 with ZeRO-1 and ZeRO-3, cp2 (the norm is per
position), and tp2 + SP × dp2 with ZeRO-1 (world 4; tp with ZeRO-3 runs in the layout fuzz, tests/parallel/layout_fuzz.py): loss, gradient norm and final weights within dp_harness.TOL
of one process. A norm gradient left unsummed over tp moves the weights by 4e-3.
"""

from __future__ import annotations

import dp_harness as H
from layout_fuzz import Combo, check
from parallel_world import run_world

from meshlm.parallel.mesh import ParallelDims

STEPS = 2
H.MODELS.setdefault("qwen3_exact", {**H.MODELS["llama"], "n_kv_heads": 1, "qk_norm": True, "head_size": 16})
# name: (tp, pp, dp, cp, sp, zero, recompute), by world size
LAYOUTS = {
    2: {"tp2_sp_selective": (2, 1, 1, 1, True, 0, "selective"), "tp2_full": (2, 1, 1, 1, False, 0, "full"),
        "pp2": (1, 2, 1, 1, False, 0, "none"), "dp2_zero1": (1, 1, 2, 1, False, 1, "none"),
        "dp2_zero3": (1, 1, 2, 1, False, 3, "none"), "cp2": (1, 1, 1, 2, False, 0, "none")},
    4: {"tp2_sp_dp2_zero1": (2, 1, 2, 1, True, 1, "none")},
}
_REF: dict = {}  # the one-process run, computed before the worlds are forked


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (tp, pp, dp, cp, sp, zero, recompute) in LAYOUTS[world].items():
            cfg = H.config("qwen3_exact", tp=tp, pp=pp, dp=dp, zero=zero, cp=cp, sp=sp,
                           train={"recompute": recompute})
            run = H.train(cfg, ParallelDims.build(tp=tp, pp=pp, dp=dp, cp=cp, timeout_s=60), STEPS)
            got = H.compare(_REF, run)
            out[name] = (got["loss"], got["grad_norm"], got["weights"])
    return out


def test_qk_norm_under_tp_sp_pp_dp_zero_cp_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        _REF.update(H.reference("qwen3_exact", STEPS))
    ref = _REF["states"][STEPS]
    assert float((ref["layers.0.attn.k_norm.weight"] - 1).abs().max()) > 1e-4  # the norms train
    seen = {}
    for world in LAYOUTS:
        for result in run_world(_world, world, tmp_path / f"world{world}"):
            for name, got in result.items():
                seen[name] = tuple(map(max, seen.get(name, (0.0,) * 3), got))  # (loss, norm, weights)
    assert sorted(seen) == sorted(n for layouts in LAYOUTS.values() for n in layouts)
    bad = {name: worst for name, worst in seen.items() if max(worst) >= H.TOL}
    assert not bad, bad


def test_qk_norm_trains_under_tp_sp_with_zero3_as_one_process(tmp_path):
    """tp2 + SP × dp2 with ZeRO-3 (FSDP2), through `meshlm train`'s trainer in fp32 (the layout fuzz's check and
    tolerances): every step's loss and gradient norm, and the final weights, as one process."""
    row = check(Combo(family="qwen3", tp=2, sp=True, dp=2, zero=3, recompute="selective"), tmp_path / "layout", {},
                reference_root=tmp_path / "ref")
    assert row["outcome"] == "pass", row["message"]
