"""Gradient norms (and so clipping) under tensor and pipeline parallelism equal one process's, in fp32.

The difference this guards against (meshlm issue 48): one process and pure dp/cp took the norm from
`torch.nn.utils.clip_grad_norm_`, whose fp32 `vector_norm` on the CPU accumulates the squares of a large
tensor with a relative error that grows with its size (5e-6 for 0.5M elements, 9.5e-6 for gpt-tiny's 3.2M-element
embedding gradient, torch 2.13), while tp and pp summed each rank's squares with `grads.local_square_sum`:
the logged norms of tp=2 and pp=2 were 1e-5 above one process's at step 1, clipping then scaled every
update differently and the runs drifted apart. Now every layout sums the squares the same way.

Checked here: one process's norm against the exact (float64) norm of the same gradients; then tp2 (the
vocabulary padded: 16,381 rows over 2 ranks), pp2 (the tied embedding on both stages) and tp2 × pp2 against one
process, 3 clipped AdamW steps in fp32 (clipping active at every step), loss and norm within 1e-6 relative
at every step; and the same layouts in float64 within 1e-12. The model's tied embedding has 524k elements: where
torch's fp32 norm is already off by 5e-6 and fp32 rounding between layouts is not.
"""

from __future__ import annotations

import dp_harness as H
import torch
from parallel_world import run_world

from meshlm.families.registry import get_spec
from meshlm.families.spec import family_loss
from meshlm.parallel.data import GradSync
from meshlm.parallel.mesh import ParallelDims

# gpt-tiny's shape in small, with a vocabulary large enough to show an inexact fp32 norm (odd: padded under tp2)
H.MODELS.setdefault("gpt_vocab", {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 16,
                                  "vocab_size": 16381})
STEPS = 3
FP32_TOL, FP64_TOL = 1e-6, 1e-12
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}  # world 2: (tp, pp)
LAYOUTS4 = {"tp2_pp2": (2, 2)}


def test_one_process_norm_is_the_exact_norm():
    """`GradSync.clip_grad_norm_` (one process, and dp/cp at ZeRO-0) against the float64 norm of the same
    fp32 gradients: torch's fp32 `clip_grad_norm_` was 2e-6 to 1e-5 off on tensors of this size."""
    with H.one_thread():
        cfg = H.config("gpt_vocab")
        torch.manual_seed(H.SEED)
        model = get_spec("gpt").model_class(cfg.model)
        x, y = H.build_run(cfg, None).loader.next()
        loss_fn = family_loss(get_spec("gpt"), cfg.model)
        loss_fn(model(x), y).backward()
        grads = [p.grad.detach().double() for p in model.parameters() if p.grad is not None]
        exact = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norm = GradSync(model, ParallelDims()).clip_grad_norm_(float("inf"))
    assert float(norm.double() / exact - 1) ** 2 < 1e-14, (float(norm), float(exact))  # within 1e-7 relative


def _world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    for dtype in ("fp32", "fp64"):
        for name, (tp, pp) in (LAYOUTS if world == 2 else LAYOUTS4).items():
            with H.float64() if dtype == "fp64" else H.one_thread():
                cfg = H.config("gpt_vocab", tp=tp, pp=pp)
                run = H.train(cfg, ParallelDims.build(tp=tp, pp=pp, dp=1, timeout_s=60), STEPS)
                out[(name, dtype)] = (run.losses, run.norms)
    return out


def _reference() -> dict:
    out = {}
    for dtype in ("fp32", "fp64"):
        with H.float64() if dtype == "fp64" else H.one_thread():
            run = H.train(H.config("gpt_vocab"), None, STEPS)
        out[dtype] = (run.losses, run.norms)
    return out


def test_tp_and_pp_norms_match_one_process(tmp_path):
    with H.one_thread():
        ref = _reference()
    assert min(ref["fp32"][1]) > H.CLIP  # clipping is active at every step: a wrong norm changes the update
    seen = {}
    for world in (2, 4):
        for result in run_world(_world, world, tmp_path / f"world{world}"):
            for key, value in result.items():
                seen.setdefault(key, value)  # every rank reports the same global values
    assert sorted(seen) == sorted((n, d) for n in (*LAYOUTS, *LAYOUTS4) for d in ("fp32", "fp64"))
    rel = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    worst = {key: (rel(losses, ref[key[1]][0]), rel(norms, ref[key[1]][1])) for key, (losses, norms) in seen.items()}
    bad = {key: w for key, w in worst.items() if max(w) >= (FP32_TOL if key[1] == "fp32" else FP64_TOL)}
    assert not bad, bad
