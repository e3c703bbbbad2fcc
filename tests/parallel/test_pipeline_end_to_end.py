"""Pipeline-parallel training equals the single-process run: one world of 4 processes (gloo).

The world holds several layouts in turn: pp=4; pp=2 (as pp=2 × dp=2: two independent pipelines fed the
same data, no data-parallel reduction, so each gets twice the global batch to keep m micro-batches);
pp=2 × vpp=2 (interleaved); tp=2 × pp=2 with and without sequence parallelism; uneven partitions (7 layers
on pp=2, 6 on pp=4, explicit `pp_layers`); GPipe (m < pp); and llama-tiny (untied head, RoPE, GQA).
Models are gpt-tiny-shaped but small (8 layers of width 32, vocabulary 101, 16 tokens), float64, dropout
off; 3 clipped AdamW steps of m = 8 micro-batches against the same model trained by accumulation in one
process (computed once, by the test process, and handed to every rank). Checked: per-step losses and gradient norms within 1e-9 relative, final weights within 1e-9
(each stage its own, together covering every parameter), tied embedding copies bit-equal, the evaluation
forward's loss, and the order in which each stage ran its forwards and backwards.
"""

from __future__ import annotations

import functools

import dp_harness as H
import pytest
import torch
from parallel_world import run_world
from pipeline_orders import expected_1f1b, expected_interleaved, max_in_flight

from meshlm.core.config import OptimConfig, build
from meshlm.families.registry import get_spec, spec_of
from meshlm.models.gpt import GPT
from meshlm.models.loss import cross_entropy
from meshlm.parallel.materialize import materialize
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.pipeline import build_pipeline, cut_stages, fused_head
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor import apply_tensor_parallel, finish_grads, full_state_dict
from meshlm.train.optim import build_optimizer

STEPS, SEED, LR, CLIP = 3, 1234, 1e-3, 0.5
TOL = H.TOL  # float64 runs: why, and why 1e-9, in dp_harness
MICRO_BATCH_SIZE, MICROBATCHES = 2, 8  # > 1 sequence: SP then hands stages a permuted layout
RECORD_STEP = 1  # the forward/backward order is recorded on the second step (the first also infers shapes)

# name: (model, n_layers, dims (tp, pp), vpp, dp replicas, micro-batches, extra parallel keys)
LAYOUTS = {
    "pp2": ("gpt", 8, (1, 2), 1, 2, MICROBATCHES, {}),
    "pp4": ("gpt", 8, (1, 4), 1, 1, MICROBATCHES, {}),
    "pp2_vpp2": ("gpt", 8, (1, 2), 2, 2, MICROBATCHES, {}),
    "tp2_pp2": ("gpt", 8, (2, 2), 1, 1, MICROBATCHES, {}),
    "tp2_pp2_sp": ("gpt", 8, (2, 2), 1, 1, MICROBATCHES, {"sp": True}),
    "uneven7_pp2": ("gpt", 7, (1, 2), 1, 2, MICROBATCHES, {}),
    "uneven6_pp4": ("gpt", 6, (1, 4), 1, 1, MICROBATCHES, {}),
    "explicit_pp4": ("gpt", 8, (1, 4), 1, 1, MICROBATCHES, {"pp_layers": [1, 3, 3, 1]}),
    "gpipe_pp4_m2": ("gpt", 8, (1, 4), 1, 1, 2, {}),
    "llama_pp2_vpp2": ("llama", 8, (1, 2), 2, 2, MICROBATCHES, {}),
}
MODELS = {
    "gpt": {"hidden_size": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 101},
    "llama": {"hidden_size": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16, "vocab_size": 101, "position": "rope",
              "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False},
}


def _config(layout: str):
    model, n_layers, (tp, pp), vpp, dp, m, extra = LAYOUTS[layout]
    return build({"model": {**MODELS[model], "n_layers": n_layers},
                  "train": {"micro_batch_size": MICRO_BATCH_SIZE, "global_batch_size": m * MICRO_BATCH_SIZE * dp},
                  "parallel": {"tp": tp, "pp": pp, "vpp": vpp, "timeout_s": 60, **extra}})


def _batches(cfg, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m micro-batches stacked on dim 0, the same every step (memorised, so the loss falls)."""
    data = torch.randint(0, cfg.model.vocab_size, (m * MICRO_BATCH_SIZE, cfg.model.seq_len + 1),
                         generator=torch.Generator().manual_seed(7))
    return data[:, :-1], data[:, 1:]


def _reference(cfg, m: int) -> dict:
    """The trainer's accumulation loop in one process."""
    torch.manual_seed(SEED)
    model = GPT(cfg.model)
    opt = build_optimizer(model, OptimConfig(lr=LR))
    x, y = _batches(cfg, m)
    losses, norms = [], []
    for _ in range(STEPS):
        total = torch.zeros(())
        for xb, yb in zip(x.chunk(m), y.chunk(m)):
            loss = cross_entropy(model(xb), yb) / m
            loss.backward()
            total += loss.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
    with torch.no_grad():
        val = float(cross_entropy(model((x[:2] + 1) % cfg.model.vocab_size), y[:2]))  # a different batch for evaluation
    return {"losses": losses, "norms": norms, "state": model.state_dict(), "val": val}


def _record_order(pipe, log: list, on: list) -> None:
    """Log ("F"|"B", stage, micro-batch) as each stage starts a forward, and as its backward starts (the
    gradient of its output arrives)."""
    for stage, module in zip(pipe.stage_ids, pipe.modules):
        counter = [0]

        def hook(mod, args, out, stage=stage, counter=counter):
            if not on[0]:
                return
            mb = counter[0]
            counter[0] += 1
            log.append(("F", stage, mb))
            if out.requires_grad:
                out.register_hook(lambda grad, mb=mb: log.append(("B", stage, mb)))

        module.register_forward_hook(hook)


def _pipelined(layout: str) -> dict:
    cfg = _config(layout)
    _, _, (tp, pp), _, _, m, _ = LAYOUTS[layout]
    dims = ParallelDims.build(tp=tp, pp=pp, timeout_s=60)
    torch.manual_seed(SEED)
    with torch.device("meta"):  # built on the meta device; this rank's stages (and tp shards) made real
        model = GPT(cfg.model)
    spec = get_spec("gpt")
    loss_fn = cross_entropy
    if tp > 1:
        loss_fn = apply_tensor_parallel(model, dims, cfg.parallel.sp, TPRNGTracker(SEED, dims.tp_rank), spec=spec_of(model))
    cut = cut_stages(model, spec, cfg, dims.pp_rank, fused_head(cfg, dims, spec))
    materialize(model, spec, dims.device)
    pipe = build_pipeline(model, spec, dims, cfg, loss_fn, cut)
    assert pipe.n_microbatches == m
    opt = build_optimizer(model, OptimConfig(lr=LR))
    order, recording = [], [False]
    _record_order(pipe, order, recording)
    x, y = _batches(cfg, m)
    losses, norms = [], []
    for step in range(STEPS):
        recording[0] = step == RECORD_STEP
        losses.append(float(pipe.train_step(x, y)))
        finish_grads(model, dims)  # tensor parallel (SP norms), then the tied embedding copies
        pipe.finish_grads()
        norms.append(float(pipe.clip_grad_norm_(model, CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    val = float(pipe.eval_loss((x[:2] + 1) % cfg.model.vocab_size, y[:2]))
    state = full_state_dict(model) if tp > 1 else model.state_dict()
    return {"losses": losses, "norms": norms, "val": val, "state": {k: v.detach().clone() for k, v in state.items()},
            "order": order, "stage_ids": pipe.stage_ids, "counts": pipe.layer_counts, "coords": dims.coords,
            "schedule": type(pipe.schedule).__name__}


def _compare(ref: dict, got: dict) -> dict:
    rel = lambda a, b: abs(a - b) / abs(b)
    return {"loss": max(rel(a, b) for a, b in zip(got["losses"], ref["losses"])),
            "grad_norm": max(rel(a, b) for a, b in zip(got["norms"], ref["norms"])),
            "val": rel(got["val"], ref["val"]),
            "weights": max(float((v - ref["state"][k]).abs().max()) for k, v in got["state"].items()),
            "keys": sorted(got["state"]), "all_keys": sorted(ref["state"]), "losses": got["losses"]}


def _references() -> dict:
    """The one-process run of each distinct (model, micro-batches), in float64 (see dp_harness.TOL)."""
    refs = {}
    with H.float64(), H.one_thread():
        for layout, (_, _, _, _, _, m, _) in LAYOUTS.items():
            cfg = _config(layout)
            if (cfg.model, m) not in refs:
                refs[(cfg.model, m)] = _reference(cfg, m)
    return refs


def _worker(refs: dict, rank: int, world: int, out_dir: str) -> dict:
    torch.set_default_dtype(torch.float64)  # this forked process only: see dp_harness.TOL
    out = {}
    for layout, (_, _, _, _, _, m, _) in LAYOUTS.items():
        cfg = _config(layout)
        got = _pipelined(layout)
        out[layout] = {**_compare(refs[(cfg.model, m)], got), **{k: got[k] for k in ("order", "stage_ids", "counts",
                                                                              "coords", "schedule")},
                       "tied": {k: got["state"][k] for k in ("tok_emb.weight", "lm_head.weight") if k in got["state"]}}
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(functools.partial(_worker, _references()), 4, tmp_path_factory.mktemp("pp_e2e"),
                     deadline_s=180)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_training_matches_single_process(world4, layout):
    for rank, res in enumerate(world4):
        diff = res[layout]
        assert diff["loss"] <= TOL, f"rank {rank}: per-step loss off by {diff['loss']:.2e} relative"
        assert diff["grad_norm"] <= TOL, f"rank {rank}: gradient norm off by {diff['grad_norm']:.2e} relative"
        assert diff["weights"] <= TOL, f"rank {rank}: final weights off by {diff['weights']:.2e}"
        assert diff["val"] <= TOL, f"rank {rank}: evaluation loss off by {diff['val']:.2e} relative"
        assert diff["losses"][-1] < diff["losses"][0], f"the model should learn something in {STEPS} steps"
    # The stages of one pipeline together hold every parameter of the plain model under its plain name.
    held = {k for res in world4 for k in res[layout]["keys"]}
    assert held == set(world4[0][layout]["all_keys"])


def test_partitions_used(world4):
    assert world4[0]["uneven7_pp2"]["counts"] == [4, 3]  # the head (≈ 0.26 layer here) tips the balance
    assert world4[0]["uneven6_pp4"]["counts"] == [1, 2, 2, 1]
    assert world4[0]["explicit_pp4"]["counts"] == [1, 3, 3, 1]
    assert world4[0]["pp2_vpp2"]["counts"] == [2, 2, 2, 2]
    assert [res["pp2_vpp2"]["stage_ids"] for res in world4] == [[0, 2], [0, 2], [1, 3], [1, 3]]  # pp × dp
    assert world4[0]["gpipe_pp4_m2"]["schedule"] == "ScheduleGPipe"
    assert world4[0]["pp4"]["schedule"] == "Schedule1F1B"
    assert world4[0]["pp2_vpp2"]["schedule"] == "ScheduleInterleaved1F1B"


@pytest.mark.parametrize("layout", ["pp2", "pp4", "pp2_vpp2", "tp2_pp2", "uneven6_pp4"])
def test_tied_embedding_copies_stay_bit_equal(world4, layout):
    first = [r[layout]["tied"]["tok_emb.weight"] for r in world4 if 0 in r[layout]["stage_ids"]]
    last = [r[layout]["tied"]["lm_head.weight"] for r in world4 if max(r[layout]["stage_ids"]) ==
            max(max(x[layout]["stage_ids"]) for x in world4)]
    assert first and len(first) == len(last)
    for a, b in zip(first, last):  # same (dp, tp) coordinate, in rank order
        assert torch.equal(a, b), "the first and last stage's copies of the tied embedding diverged"


@pytest.mark.parametrize("layout", ["pp4", "pp2"])
def test_1f1b_runs_warmup_steady_cooldown(world4, layout):
    pp = LAYOUTS[layout][2][1]
    for res in world4:
        r = res[layout]["coords"][0]
        got = res[layout]["order"]
        assert got == expected_1f1b(pp, MICROBATCHES, r), f"stage {r}: {got}"
        assert max_in_flight(got) == min(MICROBATCHES, pp - r), "1F1B keeps at most pp − rank micro-batches alive"


@pytest.mark.parametrize("layout", ["pp2_vpp2", "llama_pp2_vpp2"])
def test_interleaved_order(world4, layout):
    for res in world4:
        r = res[layout]["coords"][0]
        assert res[layout]["order"] == expected_interleaved(2, 2, MICROBATCHES, r)


def test_report_max_diffs(world4, capsys):
    """Not a check: prints the measured worst differences (pytest -s shows them)."""
    lines = []
    for layout in LAYOUTS:
        worst = {k: max(r[layout][k] for r in world4) for k in ("loss", "grad_norm", "weights", "val")}
        lines.append(f"{layout:>15}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    with capsys.disabled():
        print("\nworst differences from pp=1 (loss, grad_norm, val relative; weights absolute):\n" + "\n".join(lines))
