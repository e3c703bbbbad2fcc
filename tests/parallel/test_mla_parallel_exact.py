"""Multi-head latent attention (`model.attention='mla'`, models/mla.py) under tp, sp, pp and dp equal one process
(issue 46, item 3).

Under tp the heads are split (`q_up`/`kv_up` column-parallel, `proj` row-parallel) while the down projections
and the latent norms are computed whole on every rank; their gradients are whole because what follows them is
column-parallel (its backward sums the input gradient over tp), except the rope key all heads share, which each
rank uses for its heads only: its gradient is summed over tp (`rope_key_region`). Under SP the tokens are gathered
once before the replicated projections. Under cp the ring attention runs on the unpadded q, k (d_n + d_r) and v
(d_v) at MLA's softmax scale, 1/√(d_n + d_r) · mscale² (YaRN here, so a ring at 1/√width would be off).
Checked in float64 (dp_harness), 2 clipped AdamW steps, with q compression, YaRN and values narrower than
queries/keys (the padded cache width): tp2 (+SP, selective recompute), tp2 with full recompute, pp2, dp2 with
ZeRO-1 and ZeRO-3, cp2, cp2 with selective and with full recompute, a tp2 + SP checkpoint resumed under pp2, and (world 4)
tp2 + SP × cp2: loss, gradient norm and final weights within dp_harness.TOL of one process. Packed documents
under cp2 (with and without selective recompute, which replays the ring with the ids it saved): one forward and
backward, loss and gradients within dp_harness.TOL of one process's.
"""

from __future__ import annotations

import dp_harness as H
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_world import run_world

from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.parallel.mesh import ParallelDims

STEPS = 2
H.MODELS.setdefault("mla_exact", {**{k: v for k, v in H.MODELS["llama"].items() if k != "n_kv_heads"},
                                  "attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                                  "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_scaling": "yarn", "rope_factor": 4.0,
                                  "rope_original_len": 8, "rope_mscale_all_dim": 1.0})
# name: (tp, pp, dp, cp, sp, zero, recompute), by world size
LAYOUTS = {
    2: {"tp2_sp_selective": (2, 1, 1, 1, True, 0, "selective"), "tp2_full": (2, 1, 1, 1, False, 0, "full"),
        "pp2": (1, 2, 1, 1, False, 0, "none"), "dp2_zero1": (1, 1, 2, 1, False, 1, "none"),
        "dp2_zero3": (1, 1, 2, 1, False, 3, "none"), "cp2": (1, 1, 1, 2, False, 0, "none"),
        "cp2_selective": (1, 1, 1, 2, False, 0, "selective"), "cp2_full": (1, 1, 1, 2, False, 0, "full")},
    4: {"tp2_sp_cp2": (2, 1, 1, 2, True, 0, "none")},
}
_REF: dict = {}  # the one-process run, computed before the world is forked
EOD = 7


def _documents(recompute: str) -> dict:
    """Two rows of packed documents (positions restart after each EOD; the ring masks by the document ids) under
    cp2: the loss and the gradients (summed over the ring, /cp) against one process's, relative and absolute."""
    from meshlm.data.documents import document_positions
    from meshlm.families.registry import get_spec
    from meshlm.parallel import build_model

    cfg = H.config("mla_exact", cp=2, train={"recompute": recompute})
    spec = get_spec(cfg.model.family)
    torch.manual_seed(H.SEED)
    ref = spec.model_class(cfg.model)
    torch.manual_seed(H.SEED)
    par = build_model(cfg, ParallelDims.build(cp=2, timeout_s=60), spec=spec)
    ids = torch.randint(8, cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(5))
    ids[0, [3, 9]] = ids[1, 12] = EOD
    x, y = ids[:, :-1], ids[:, 1:]
    positions, segments = document_positions(x, EOD)
    want = F.cross_entropy(ref(x, positions=positions, segments=segments).flatten(0, 1), y.flatten())
    want.backward()
    got = par.loss_fn(par.model(x, positions=positions, segments=segments), y)
    got.backward()
    grads = {n: p.grad.clone() for n, p in par.model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    return {"loss": float((got - want).abs()) / float(want),
            "grads": max(float((grads[n] / 2 - p.grad).abs().max()) for n, p in ref.named_parameters())}


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (tp, pp, dp, cp, sp, zero, recompute) in LAYOUTS[world].items():
            cfg = H.config("mla_exact", tp=tp, pp=pp, dp=dp, zero=zero, cp=cp, sp=sp, train={"recompute": recompute})
            run = H.train(cfg, ParallelDims.build(tp=tp, pp=pp, dp=dp, cp=cp, timeout_s=60), STEPS)
            got = H.compare(_REF, run)
            out[name] = (got["loss"], got["grad_norm"], got["weights"])
        if world != 2:
            return out
        for recompute in ("none", "selective"):
            got = _documents(recompute)
            out[f"cp2_documents_{recompute}"] = (got["loss"], got["grads"], 0.0)
        # a layout change: one step under tp2 + SP, saved (layout-free pieces), resumed under pp2 for the second
        first = H.train(H.config("mla_exact", tp=2, sp=True), ParallelDims.build(tp=2, timeout_s=60), 1)
        H.save(first, f"{out_dir}/tp2_sp", {})
        run = H.resume(H.config("mla_exact", pp=2), ParallelDims.build(pp=2, timeout_s=60),
                       resolve_checkpoint(f"{out_dir}/tp2_sp"))
        H.step(run)
        got = H.compare(_REF, run)
        out["tp2_sp_saved_then_pp2"] = (got["loss"], got["grad_norm"], got["weights"])
    return out


def test_mla_under_tp_sp_pp_dp_zero_cp_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        _REF.update(H.reference("mla_exact", STEPS))
    ref = _REF["states"][STEPS]
    assert float((ref["layers.0.attn.kv_norm.weight"] - 1).abs().max()) > 1e-4  # the latent path trains
    seen = {}
    for world in LAYOUTS:
        for result in run_world(_world, world, tmp_path / f"world{world}"):
            for name, got in result.items():
                seen[name] = tuple(map(max, seen.get(name, (0.0,) * 3), got))  # (loss, norm, weights)
    documents = ["cp2_documents_none", "cp2_documents_selective"]
    assert sorted(seen) == sorted([*LAYOUTS[2], *LAYOUTS[4], "tp2_sp_saved_then_pp2", *documents])
    bad = {name: worst for name, worst in seen.items() if max(worst) >= H.TOL}
    assert not bad, bad
