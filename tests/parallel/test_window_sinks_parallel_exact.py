"""Sliding-window attention with gpt-oss's attention sinks (`model.sliding_window`, `model.window_pattern`,
`model.attention_sinks`) under every layout that supports them equal one process (issue 46).

The sink logits are whole on every tp rank while the heads they belong to are split: each rank's core reads its
heads' entries (`Attention.head_offset`) and its gradient holds only those, summed over tp as the per-head norms'
are. Float64 (dp_harness), 2 clipped AdamW steps, one KV head and 4 query heads, layer 0 local with a window of 5
over rows of 16, layer 1 global: tp2 (+SP, selective recompute), tp2 with full recompute, pp2, dp2 with ZeRO-1
and ZeRO-3, cp2 (the ring masks each block by the band and adds the sinks to its final denominator, their
gradient from the saved log-sum-exp; chunks of 4, so the window crosses chunks and ranks), cp2 with selective
recompute, tp2 + SP × dp2 with ZeRO-1 and tp2 × cp2 (world 4): loss, gradient norm and final weights within
dp_harness.TOL of one process.

Gemma 3's layer (`gemma3_exact`: the same windows without sinks, the local layer with its own RoPE base, (1 + w)
norms on the residual stream, the sandwich outputs and each head's q and k, scaled tied embeddings, a softmax scale
apart from 1/√head_dim, GeGLU) runs the world-2 layouts in the same worlds: the sandwich norms are per token as the
others (summed over tp under SP), the (1 + w) q/k norms per head as Qwen3's, and the ring reads the layer's scale.
"""

from __future__ import annotations

import dp_harness as H
from parallel_world import run_world

from meshlm.parallel.mesh import ParallelDims

STEPS = 2
H.MODELS.setdefault("window_sinks_exact", {**H.MODELS["llama"], "n_kv_heads": 1, "sliding_window": 5,
                                           "window_pattern": 2, "attention_sinks": True})
H.MODELS.setdefault("gemma3_exact", {**H.MODELS["llama"], "n_kv_heads": 1, "head_size": 16, "qk_norm": True,
                                     "activation": "geglu", "sliding_window": 5, "window_pattern": 2,
                                     "norm_unit_offset": True, "sandwich_norm": True, "embed_scale": True,
                                     "attn_scale_dim": 12.0, "rope_local_theta": 100.0, "tie_embeddings": True})
MODELS = {2: ("window_sinks_exact", "gemma3_exact"), 4: ("window_sinks_exact",)}  # the models each world runs
# name: (tp, pp, dp, cp, sp, zero, recompute), by world size
LAYOUTS = {
    2: {"tp2_sp_selective": (2, 1, 1, 1, True, 0, "selective"), "tp2_full": (2, 1, 1, 1, False, 0, "full"),
        "pp2": (1, 2, 1, 1, False, 0, "none"), "dp2_zero1": (1, 1, 2, 1, False, 1, "none"),
        "dp2_zero3": (1, 1, 2, 1, False, 3, "none"), "cp2": (1, 1, 1, 2, False, 0, "none"),
        "cp2_selective": (1, 1, 1, 2, False, 0, "selective")},
    4: {"tp2_sp_dp2_zero1": (2, 1, 2, 1, True, 1, "none"), "tp2_cp2": (2, 1, 1, 2, False, 0, "none")},
}
_REF: dict = {}  # model → the one-process run, computed before the worlds are forked


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for model in MODELS[world]:
            for name, (tp, pp, dp, cp, sp, zero, recompute) in LAYOUTS[world].items():
                cfg = H.config(model, tp=tp, pp=pp, dp=dp, zero=zero, cp=cp, sp=sp, train={"recompute": recompute})
                run = H.train(cfg, ParallelDims.build(tp=tp, pp=pp, dp=dp, cp=cp, timeout_s=60), STEPS)
                got = H.compare(_REF[model], run)
                out[f"{model}:{name}"] = (got["loss"], got["grad_norm"], got["weights"])
    return out


def test_window_and_sinks_under_tp_sp_pp_dp_zero_cp_match_one_process(tmp_path):
    with H.float64(), H.one_thread():
        for model in MODELS[2]:
            _REF[model] = H.reference(model, STEPS)
    ref = _REF["window_sinks_exact"]["states"][STEPS]
    assert float(ref["layers.0.attn.sinks"].abs().min()) > 1e-4  # every head's sink trains
    gemma = _REF["gemma3_exact"]["states"][STEPS]
    for name in ("layers.0.post_attn_norm.weight", "layers.1.post_mlp_norm.weight", "layers.0.attn.k_norm.weight"):
        assert float(gemma[name].abs().min()) > 1e-4, name  # Gemma's norms train away from their 0 start
    seen = {}
    for world in LAYOUTS:
        for result in run_world(_world, world, tmp_path / f"world{world}"):
            for name, got in result.items():
                seen[name] = tuple(map(max, seen.get(name, (0.0,) * 3), got))  # (loss, norm, weights)
    assert sorted(seen) == sorted(f"{m}:{n}" for world, layouts in LAYOUTS.items() for m in MODELS[world]
                                  for n in layouts)
    bad = {name: worst for name, worst in seen.items() if max(worst) >= H.TOL}
    assert not bad, bad

