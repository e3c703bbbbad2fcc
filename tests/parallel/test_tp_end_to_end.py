"""Tensor (and sequence) parallel training equals the single-process run: one world of 4 processes (gloo).

The world holds two layouts at once: tp=4, and tp=2 × dp=2 (two independent tp=2 replicas fed the same
data, no data-parallel reduction). On every rank, `gpt-tiny` and `llama-tiny` (GQA with 2 KV heads: split
at tp=2, replicated at tp=4), shrunk to 2 layers of width 32 and a vocabulary of 101 (padded), train 3
AdamW steps of 2 micro-batches with clipping active, float64, dropout off, against the same model trained
without tensor parallelism (once, by the test process, handed to every rank). Checked: per-step losses and gradient norms within 1e-9 relative,
and the gathered final weights within 1e-9. The same world checks the mesh layout and the dropout streams.
"""

from __future__ import annotations

import functools

import dp_harness as H
import pytest
import torch
import torch.distributed as dist
from parallel_world import run_world

from meshlm.core.config import ConfigError, OptimConfig, load_config
from meshlm.core.layout import check_tensor_parallel
from meshlm.families.registry import get_spec, spec_of
from meshlm.models.gpt import GPT
from meshlm.models.loss import cross_entropy
from meshlm.parallel.materialize import materialize
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor import (
    apply_tensor_parallel,
    clip_grad_norm_,
    finish_grads,
    full_state_dict,
)
from meshlm.train.optim import build_optimizer

SMALL = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=16", "--model.vocab_size=101"]
STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE, SEED = 3, 2, 2, 1234
# AdamW's update m/√v is scale-free: a gradient entry near zero whose rounding differs (sums taken in
# another order) moves its weight by a fraction of lr either way. In fp32, measured on llama-tiny, tp=2:
# final weights differed by 1.0e-5 at lr 3e-3, 3.6e-6 at lr 1e-3 (1.25e-5 on a CPU without AVX-512), and
# 7e-9 with SGD: rounding, not a TP error. So these runs are in float64 (dp_harness.TOL says why 1e-9).
LR = 1e-3
CLIP = 0.5  # small enough that clipping scales every step: a wrong tp gradient norm would show
LAYOUTS = [(2, False), (2, True), (4, False), (4, True)]
TOL = H.TOL


def _model_config(name: str, **changes):
    extra = [f"--model.{k}={v}" for k, v in changes.items()]
    return load_config(name, SMALL + extra).model


def _train(mcfg, dims: ParallelDims | None, sp: bool) -> dict:
    torch.manual_seed(SEED)
    loss_fn = cross_entropy
    if dims is None:
        model = GPT(mcfg)  # the reference: whole, from the seed
    else:  # on the meta device, sliced, then only this rank's shards made: equal to the reference's slices
        with torch.device("meta"):
            model = GPT(mcfg)
        loss_fn = apply_tensor_parallel(model, dims, sp, TPRNGTracker(SEED, dims.tp_rank), spec=spec_of(model))
        materialize(model, get_spec("gpt"), dims.device)
    opt = build_optimizer(model, OptimConfig(lr=LR, weight_decay=0.1))
    # The same two micro-batches every step: random tokens have nothing to learn across batches, but a
    # repeated batch is memorised, so the loss must fall (a check that the steps do something).
    data = torch.Generator().manual_seed(7)
    batches = torch.randint(0, mcfg.vocab_size, (MICRO_BATCHES, MICRO_BATCH_SIZE, mcfg.seq_len + 1), generator=data)
    losses, norms = [], []
    for _ in range(STEPS):
        total = 0.0
        for batch in batches:
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:]) / MICRO_BATCHES
            loss.backward()
            total += loss.item()
        if dims is not None:
            finish_grads(model, dims)
            norm = clip_grad_norm_(model, dims, CLIP)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(float(norm))
    state = full_state_dict(model) if dims is not None else model.state_dict()
    return {"losses": losses, "norms": norms, "state": {k: v.detach() for k, v in state.items()}}


def _compare(ref: dict, got: dict) -> dict:
    rel = lambda a, b: abs(a - b) / abs(b)
    assert ref["state"].keys() == got["state"].keys(), set(ref["state"]) ^ set(got["state"])
    return {"loss": max(rel(a, b) for a, b in zip(got["losses"], ref["losses"])),
            "grad_norm": max(rel(a, b) for a, b in zip(got["norms"], ref["norms"])),
            "weights": max(float((got["state"][k] - v).abs().max()) for k, v in ref["state"].items()),
            "losses": got["losses"]}


def _mesh_facts(dims2: ParallelDims, dims4: ParallelDims) -> dict:
    return {"tp2_group": dist.get_process_group_ranks(dims2.tp_group),
            "dp2_group": dist.get_process_group_ranks(dims2.dp_group),
            "tp4_group": dist.get_process_group_ranks(dims4.tp_group),
            "mesh_names": dims2.mesh.mesh_dim_names, "mesh_tp_size": dims2.mesh["tp"].size(),
            "coords": dims2.coords}


def _rng_facts(dims: ParallelDims) -> dict:
    """Dropout streams under tp=2: inside TP regions per rank, outside shared, both reproducible."""
    mcfg = _model_config("gpt-tiny", dropout=0.2)
    torch.manual_seed(SEED)
    model = GPT(mcfg)
    rng = TPRNGTracker(SEED, dims.tp_rank)
    apply_tensor_parallel(model, dims, sp=False, rng=rng, spec=spec_of(model))
    model.train()
    attn = model.layers[0].attn
    q = torch.ones(1, attn.n_heads, 8, attn.head_dim)  # equal on every rank: only the mask can differ
    state = rng.get_state()
    inside = attn.core(q, q, torch.eye(8).expand(1, attn.n_heads, 8, 8).contiguous(), True)
    rng.set_state(state)
    inside_again = attn.core(q, q, torch.eye(8).expand(1, attn.n_heads, 8, 8).contiguous(), True)
    residual = {}
    model.norm.register_forward_pre_hook(lambda m, args: residual.setdefault("x", args[0].detach()))
    model(torch.randint(0, mcfg.vocab_size, (2, mcfg.seq_len), generator=torch.Generator().manual_seed(0)))
    sp_model = GPT(mcfg)
    apply_tensor_parallel(sp_model, dims, sp=True, rng=TPRNGTracker(SEED, dims.tp_rank), spec=spec_of(sp_model))
    sp_mask = sp_model.drop(torch.ones(64))  # embedding dropout on this rank's tokens
    peers = [None] * dims.tp
    dist.all_gather_object(peers, (inside, residual["x"], sp_mask), group=dims.tp_group)
    return {"core_masks_differ": not torch.equal(peers[0][0], peers[1][0]),
            "core_is_dropped": bool((inside == 0).any()),
            "core_mask_reproducible": torch.equal(inside, inside_again),
            "residual_agrees": torch.equal(peers[0][1], peers[1][1]),
            "sp_dropout_differs": not torch.equal(peers[0][2], peers[1][2]),
            "core_mask": inside}


def _references() -> dict:
    with H.float64(), H.one_thread():  # the training comparisons: H.TOL
        return {name: _train(_model_config(name), None, False) for name in ("gpt-tiny", "llama-tiny")}


def _worker(refs: dict, rank: int, world: int, out_dir: str) -> dict:
    dims2 = ParallelDims.build(tp=2, timeout_s=60)  # tp=2 × dp=2
    dims4 = ParallelDims.build(tp=4, timeout_s=60)  # a second layout in the same world
    out = {"mesh": _mesh_facts(dims2, dims4), "rng": _rng_facts(dims2)}
    torch.set_default_dtype(torch.float64)  # the training comparisons (this forked process only): H.TOL
    for name, ref in refs.items():
        mcfg = _model_config(name)
        out[f"{name}_ref_losses"] = ref["losses"]
        for tp, sp in LAYOUTS:
            out[(name, tp, sp)] = _compare(ref, _train(mcfg, dims2 if tp == 2 else dims4, sp))
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(functools.partial(_worker, _references()), 4, tmp_path_factory.mktemp("tp_e2e"), deadline_s=150)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("tp,sp", LAYOUTS, ids=[f"tp{t}{'_sp' if s else ''}" for t, s in LAYOUTS])
def test_tp_training_matches_single_process(world4, model, tp, sp):
    for rank, res in enumerate(world4):
        diff = res[(model, tp, sp)]
        assert diff["loss"] <= TOL, f"rank {rank}: per-step loss off by {diff['loss']:.2e} relative"
        assert diff["grad_norm"] <= TOL, f"rank {rank}: gradient norm off by {diff['grad_norm']:.2e} relative"
        assert diff["weights"] <= TOL, f"rank {rank}: final weights off by {diff['weights']:.2e}"
        assert diff["losses"][-1] < diff["losses"][0], f"the model should learn something in {STEPS} steps"


def test_mesh_keeps_tp_ranks_adjacent(world4):
    for rank, res in enumerate(world4):
        mesh = res["mesh"]
        first = rank // 2 * 2
        assert mesh["tp2_group"] == [first, first + 1]
        assert mesh["dp2_group"] == [rank % 2, rank % 2 + 2]
        assert mesh["tp4_group"] == [0, 1, 2, 3]
        assert mesh["mesh_names"] == ("pp", "dp", "tp") and mesh["mesh_tp_size"] == 2
        assert mesh["coords"] == (0, rank // 2, rank % 2)


def test_dropout_differs_inside_tp_regions_and_agrees_outside(world4):
    for rank, res in enumerate(world4):
        facts = res["rng"]
        assert facts["core_is_dropped"], "dropout=0.2 should drop something in the attention core"
        assert facts["core_masks_differ"], "attention-core dropout must differ across tp ranks"
        assert facts["core_mask_reproducible"], "restoring the tracker state must redraw the same mask"
        assert facts["residual_agrees"], "dropout on the replicated residual stream must agree across tp ranks"
        assert facts["sp_dropout_differs"], "under SP, dropout on each rank's tokens must differ across tp ranks"
    # Same tp rank in the two dp replicas (ranks 0 and 2): the same stream, from the seed alone.
    assert torch.equal(world4[0]["rng"]["core_mask"], world4[2]["rng"]["core_mask"])


def test_tp_shape_errors_name_the_keys():
    llama = _model_config("llama-tiny")  # n_heads 4, n_kv_heads 2
    with pytest.raises(ConfigError, match="model.seq_len"):
        check_tensor_parallel(_model_config("gpt-tiny", seq_len=18), 4, sp=True)
    check_tensor_parallel(_model_config("gpt-tiny", seq_len=18), 2, sp=True)
    check_tensor_parallel(llama, 4, sp=False)  # KV heads replicated
    with pytest.raises(ConfigError, match="model.n_kv_heads"):
        check_tensor_parallel(_model_config("llama-tiny", n_heads=12, n_kv_heads=4, hidden_size=48), 6, sp=False)


def test_report_max_diffs(world4, capsys):
    """Not a check: prints the measured worst differences (pytest -s shows them)."""
    lines = []
    for key in [(m, t, s) for m in ("gpt-tiny", "llama-tiny") for t, s in LAYOUTS]:
        worst = {k: max(r[key][k] for r in world4) for k in ("loss", "grad_norm", "weights")}
        lines.append(f"{key[0]:>10} tp={key[1]} sp={key[2]!s:5}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    with capsys.disabled():
        print("\nworst differences from tp=1 (loss and grad_norm relative, weights absolute):\n" + "\n".join(lines))
