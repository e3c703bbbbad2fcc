"""Data parallelism, ZeRO 0–3 and tp × pp × dp train like one process, and checkpoints reshard.

Three spawned gloo worlds (8, 4 and 2 processes) and the test process itself run the cases below on
gpt-tiny/llama-tiny-shaped small models (dp_harness.py): float64, dropout off, 3 clipped AdamW steps of a
global batch of 8 samples (1 per micro-batch) read through `BatchLoader`, so each dp rank takes its slice
of the same global batch. Checked against the single-process run of the same global batches: per-step
losses and gradient norms within 1e-9 relative, final weights within 1e-9 (every rank its own part; why
float64 and 1e-9: dp_harness.TOL). Communication overlap and model-state memory are measured in fp32; the
model states inside a step are measured against the planner's count (plan.cost).

Resharding pairs (train 2 steps under the first layout, save; load under the second, 2 more steps; the 4
losses within 1e-9 relative of 4 uninterrupted single-process steps, final weights within 1e-9; the
checkpoint keeps the float64 pieces):
(1,1,1) → (2,2,2) ZeRO-1 (every dimension and the ZeRO stage change); (2,2,2) ZeRO-1 → (1,1,4) ZeRO-2;
(1,2,2) → (2,1,1); llama (4,1,2) ZeRO-2 (replicated KV heads) → (1,2,2) ZeRO-3; (1,1,4) ZeRO-3 → (1,1,1); and a one-process run's own format (`model.pt`, `optim.pt`) → (1,1,2) ZeRO-1.
Muon (`optim.name=muon`, model "gpt-muon": Muon's buffers for the hidden matrices, Adam's moments for the
rest) trains under dp=2 and pp2 × dp2 like one process and reshards (1,2,2) → (1,1,1) and one process's
format → (1,1,2).
The worlds run in that order, each picking up the checkpoints the previous one wrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dp_harness as H
import pytest
import torch
from parallel_world import run_world

from meshlm.checkpoint.single import resolve_checkpoint, save_checkpoint
from meshlm.parallel.data import theory_bytes_per_param

STEPS, HALF, TOL = 3, 2, H.TOL

# name: (model, tp, pp, dp, zero, extra parallel keys), by world size
E2E = {
    2: {**{f"dp2_zero{z}": ("gpt", 1, 1, 2, z, {}) for z in range(4)}, "dp2_muon": ("gpt-muon", 1, 1, 2, 0, {})},
    4: {"dp4_zero0": ("gpt", 1, 1, 4, 0, {}), "dp4_zero3": ("gpt", 1, 1, 4, 3, {}),
        "pp2_dp2_zero3": ("gpt", 1, 2, 2, 3, {}), "llama_pp2_dp2_zero3": ("llama", 1, 2, 2, 3, {}),
        "tp2_dp2_zero2": ("gpt", 2, 1, 2, 2, {}), "pp2_dp2_muon": ("gpt-muon", 1, 2, 2, 0, {})},
    8: {"tp2_pp2_dp2_zero0": ("gpt", 2, 2, 2, 0, {}), "tp2_pp2_dp2_zero1": ("gpt", 2, 2, 2, 1, {}),
        "tp2_pp2_dp2_zero2": ("gpt", 2, 2, 2, 2, {}), "tp2_sp_pp2_dp2_zero2": ("gpt", 2, 2, 2, 2, {"sp": True}),
        "llama_tp2_pp2_dp2_zero2": ("llama", 2, 2, 2, 2, {}), "llama_tp4_dp2_zero2": ("llama", 4, 1, 2, 2, {})},
}
# name: (model, first layout (tp, pp, dp, zero), second layout); the world size of each half says where it runs
PAIRS = {
    "111_to_222z1": ("gpt", (1, 1, 1, 0), (2, 2, 2, 1)),
    "222z1_to_114z2": ("gpt", (2, 2, 2, 1), (1, 1, 4, 2)),
    "122_to_211": ("gpt", (1, 2, 2, 0), (2, 1, 1, 0)),
    "llama_412z2_to_122z3": ("llama", (4, 1, 2, 2), (1, 2, 2, 3)),
    "114z3_to_111": ("gpt", (1, 1, 4, 3), (1, 1, 1, 0)),
    "legacy111_to_112z1": ("gpt", (1, 1, 1, 0), (1, 1, 2, 1)),  # a one-process checkpoint: model.pt, optim.pt
    "muon_122_to_111": ("gpt-muon", (1, 2, 2, 0), (1, 1, 1, 0)),
    "legacy_muon111_to_112": ("gpt-muon", (1, 1, 1, 0), (1, 1, 2, 0)),
}
MODELS = ("gpt", "llama", "gpt-muon")  # the references: a model, optionally "-" and its optimizer


def _model_optim(key: str) -> tuple[str, str]:
    model, _, optim = key.partition("-")
    return model, optim or "adamw"


def _world(layout) -> int:
    return layout[0] * layout[1] * layout[2]


def _run(key: str, tp: int, pp: int, dp: int, zero: int, **extra):
    model, optim = _model_optim(key)
    cfg = H.config(model, tp=tp, pp=pp, dp=dp, zero=zero, optim=optim, **extra)
    return cfg, (H.dims_for(tp, pp, dp) if tp * pp * dp > 1 else None)


def _first_half(name: str, root: Path) -> None:
    model, layout, _ = PAIRS[name]
    cfg, dims = _run(model, *layout)
    run = H.build_run(cfg, dims)
    for _ in range(HALF):
        H.step(run)
    if name.startswith("legacy"):  # what Trainer.save writes in one process
        state = {"step": HALF, "loader": run.loader.state_dict(), "losses": run.losses, "norms": run.norms}
        save_checkpoint(root / name, HALF, {"model": run.model.state_dict(), "optim": run.opt.state_dict(),
                                                 "state": state}, cfg.to_dict())
    else:
        H.save(run, root / name, cfg.to_dict())


def _second_half(name: str, root: Path, refs: dict) -> dict:
    model, _, layout = PAIRS[name]
    cfg, dims = _run(model, *layout)
    run = H.resume(cfg, dims, resolve_checkpoint(root / name))
    for _ in range(HALF):
        H.step(run)
    return H.compare(refs[model], run)


def _comm_facts(run) -> dict:
    """Which buckets were launched after each micro-batch's backward (overlap, none before the last)."""
    launched = []
    for i in range(run.m):
        x, y = run.loader.next()
        (run.loss_fn(run.model(x), y) / run.m).backward()
        launched.append(run.sync._next)
    n_buckets = len(run.sync.buckets)
    run.sync.finish()
    return {"launched": launched, "buckets": n_buckets}


def _memory(run) -> dict:
    """Model-state bytes after one step (before zero_grad), per parameter, beside the theory."""
    H.step_without_zero_grad(run)
    b = run.sync.state_bytes(run.opt)
    return {"per_param": (b["params"] + b["grads"] + b["optim"]) / b["n_params"],
            "theory": theory_bytes_per_param(run.sync.zero, run.dims.dp)}


def _state_tensors(run) -> tuple[list, int]:
    """Every tensor of model state on this rank: parameters, gradients, Adam's states, the buckets' flat
    gradient buffers (ZeRO-2's full-size ones and its shards) and FSDP2's unsharded gradients (ZeRO-3), and
    how many FSDP2 parameter groups were looked into (so that a torch that renamed them fails here)."""
    from torch.distributed.fsdp import FSDPModule

    tensors = []
    for p in list(run.model.parameters()) + [p for g in run.opt.param_groups for p in g["params"]]:
        tensors += [p, p.grad]
    tensors += [t for st in run.opt.state.values() for t in st.values() if torch.is_tensor(t)]
    for b in getattr(run.sync, "buckets", []):
        tensors += [b.grad, b.shard_grad]
    groups = 0
    for module in run.model.modules():
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_group is not None:
            groups += 1
            for fp in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
                tensors += [fp.unsharded_accumulated_grad, getattr(fp._unsharded_param, "grad", None)]
    return tensors, groups


def _in_step_memory(run) -> dict:
    """Model-state bytes per parameter inside the second step: the most at any module's forward (every
    micro-batch), after each backward and after the reduction; and the most during the first forward."""
    from meshlm.parallel.data import _storage_bytes

    H.step(run)  # Adam's states exist from here on
    n = sum(p.numel() for p in run.model.parameters())
    peak, first, groups = [0.0], [0.0], [0]

    def measure(*_, into=peak):
        tensors, g = _state_tensors(run)
        into[0] = max(into[0], _storage_bytes(tensors) / n)
        groups[0] = max(groups[0], g)

    hooks = [m.register_forward_pre_hook(measure) for m in run.model.modules()]
    hooks += [m.register_forward_hook(measure) for m in run.model.modules()]
    for i in range(run.m):
        x, y = run.loader.next()
        run.sync.set_last_microbatch(i == run.m - 1)
        out = run.model(x)
        if i == 0:
            first[0] = peak[0]  # the first micro-batch's forward
        (run.loss_fn(out, y) / run.m).backward()
        measure()
    run.sync.finish()
    measure()
    for h in hooks:
        h.remove()
    return {"peak": peak[0], "first": first[0], "fsdp_groups": groups[0], "microbatches": run.m}


def _worker(rank: int, world: int, out_dir: str) -> dict:
    root = Path(out_dir).parent
    refs = torch.load(root / "references.pt", weights_only=False)  # computed once, by the test process
    out = {}
    with H.float64():
        for name, (model, tp, pp, dp, zero, extra) in E2E[world].items():
            cfg, dims = _run(model, tp, pp, dp, zero, **extra)
            out[name] = H.compare(refs[model], H.train(cfg, dims, STEPS))
        for name, (_, first, second) in PAIRS.items():
            if _world(second) == world:
                out[name] = _second_half(name, root, refs)
        for name, (_, first, _) in PAIRS.items():
            if _world(first) == world:
                _first_half(name, root)
    if world == 2:
        for zero in range(3):
            cfg, dims = _run("gpt", 1, 1, 2, zero)
            out[f"comm_zero{zero}"] = _comm_facts(H.build_run(cfg, dims))
        for zero in range(4):
            cfg, dims = _run("gpt", 1, 1, 2, zero)
            out[f"memory_zero{zero}"] = _memory(H.build_run(cfg, dims))
            out[f"in_step_zero{zero}"] = _in_step_memory(H.build_run(cfg, dims))
    if world == 4:
        cfg, dims = _run("gpt", 1, 2, 2, 0)
        run = H.build_run(cfg, dims)
        batches = [run.loader.next() for _ in range(run.m)]
        run.pipe.train_step(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        out["pipeline_launched"] = (run.sync._next, len(run.sync.buckets))  # during the schedule's backward
        run.sync.finish()
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    with H.float64(), H.one_thread():
        refs = {m: H.reference(_model_optim(m)[0], max(STEPS, 2 * HALF), _model_optim(m)[1]) for m in MODELS}
        torch.save(refs, root / "references.pt")
        for name, (_, first, _) in PAIRS.items():
            if _world(first) == 1:
                _first_half(name, root)
    results = {}
    for world, deadline in ((8, 240), (4, 180), (2, 120)):
        shutil.rmtree(root / f"world{world}", ignore_errors=True)
        results[world] = run_world(_worker, world, root / f"world{world}", deadline_s=deadline)
    with H.float64(), H.one_thread():
        single = {name: _second_half(name, root, refs) for name, (_, _, second) in PAIRS.items()
                  if _world(second) == 1}
    return results, single, root


def _all(worlds, name: str) -> list[dict]:
    results, single, _ = worlds
    if name in single:
        return [single[name]]
    return [res[name] for ranks in results.values() for res in ranks if name in res]


@pytest.mark.parametrize("name", [n for cases in E2E.values() for n in cases])
def test_data_parallel_training_matches_single_process(worlds, name):
    ranks = _all(worlds, name)
    assert ranks, name
    for rank, diff in enumerate(ranks):
        assert diff["loss"] <= TOL, f"rank {rank}: per-step loss off by {diff['loss']:.2e} relative"
        assert diff["grad_norm"] <= TOL, f"rank {rank}: gradient norm off by {diff['grad_norm']:.2e} relative"
        assert diff["weights"] <= TOL, f"rank {rank}: final weights off by {diff['weights']:.2e}"
        assert diff["losses"][-1] < diff["losses"][0], f"the model should learn something in {STEPS} steps"
    held = {k for diff in ranks for k in diff["keys"]}
    assert held == set(H.full_state(H.build_run(H.config(_model_optim(E2E_MODEL[name])[0]), None))), \
        "every parameter is held"


E2E_MODEL = {n: case[0] for cases in E2E.values() for n, case in cases.items()}


@pytest.mark.parametrize("name", list(PAIRS))
def test_resume_under_another_layout_matches_uninterrupted_run(worlds, name):
    ranks = _all(worlds, name)
    assert ranks, name
    for rank, diff in enumerate(ranks):
        assert len(diff["losses"]) == 2 * HALF
        assert diff["loss"] <= TOL, f"rank {rank}: the {2 * HALF} losses are off by {diff['loss']:.2e} relative"
        assert diff["weights"] <= TOL, f"rank {rank}: final weights off by {diff['weights']:.2e}"


def test_no_reduction_before_the_last_microbatch_and_overlap_with_backward(worlds):
    results, _, _ = worlds
    for res in results[2]:
        for zero in range(3):
            facts = res[f"comm_zero{zero}"]
            *early, last = facts["launched"]
            assert facts["buckets"] > 2, "the test model should span several buckets"
            assert early == [0] * len(early), "no bucket may be reduced before the step's last micro-batch"
            assert last == facts["buckets"], "every bucket is launched during the last backward (overlapped)"
    for res in results[4]:
        launched, buckets = res["pipeline_launched"]
        assert launched == buckets, "under the 1F1B schedule the buckets are launched inside its backwards"


@pytest.mark.parametrize("zero", range(4))
def test_model_state_memory_matches_theory(worlds, zero):
    results, _, _ = worlds
    for res in results[2]:
        mem = res[f"memory_zero{zero}"]
        # within 3%: bucket and FSDP padding, Adam's step counters
        assert abs(mem["per_param"] - mem["theory"]) <= 0.03 * mem["theory"], mem


@pytest.mark.parametrize("zero", range(4))
def test_model_states_inside_a_step_are_what_the_planner_counts(worlds, zero):
    """The planner's model states of this layout (plan.cost: weights, gradients at the peak, Adam's states,
    ZeRO-3's gathered weights) against the most this runtime holds at any point of a step of 4 micro-batches:
    the bucketed ZeRO-2 keeps full-size buffers from the second micro-batch on and its shards beside them
    after the last backward (the moment the planner pairs with spent activations: activations 0 here);
    FSDP2 accumulates unsharded gradients while gradient sync is off."""
    from meshlm.plan.catalog import get_gpu
    from meshlm.plan.cost import Candidate, Cluster, Options, gradient_bytes
    from meshlm.plan.search import evaluate

    results, _, _ = worlds
    cfg = H.config("gpt", dp=2, zero=zero)
    est = evaluate(cfg, Candidate(1, 1, 2, zero=zero), Cluster(get_gpu("a100-80gb"), 2, 2),
                   cfg.train.global_batch_size, Options(precision="fp32", device_type="cpu"))
    n = est.memory["optimizer states"] / (8.0 if zero == 0 else 4.0)  # Adam's 8 B/param, over dp=2 under ZeRO
    states = {k: v for k, v in est.memory.items()
              if k not in ("activations", "logits (last stage)", "reserved (context, buffers)")}
    states["gradients"] = gradient_bytes(4.0 * n, zero, 2, 4, "fp32", activations=0.0)
    for res in results[2]:
        got = res[f"in_step_zero{zero}"]
        assert got["microbatches"] == 4
        layers = H.MODELS["gpt"]["n_layers"]
        assert got["fsdp_groups"] == (layers + 1 if zero == 3 else 0), "FSDP2's parameter groups: each layer, the root"
        # within 1%: bucket padding, Adam's step counters
        assert got["peak"] == pytest.approx(sum(states.values()) / n, rel=0.01), (got, states)
    if zero == 2:  # no gradient buffer lives between steps: the first micro-batch runs beside 4 + 8/2 B/param
        assert all(res["in_step_zero2"]["first"] == pytest.approx(8.0, rel=0.01) for res in results[2])


def test_report_max_diffs(worlds, capsys):
    """Not a check: prints the measured worst differences (pytest -s shows them)."""
    lines = []
    for name in [n for cases in E2E.values() for n in cases] + list(PAIRS):
        worst = {k: max(d[k] for d in _all(worlds, name)) for k in ("loss", "grad_norm", "weights")}
        lines.append(f"{name:>24}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    results, _, _ = worlds
    mem = [f"ZeRO-{z}: {results[2][0][f'memory_zero{z}']['per_param']:.2f} B/param (theory "
           f"{results[2][0][f'memory_zero{z}']['theory']:.2f})" for z in range(4)]
    inside = [f"ZeRO-{z}: {results[2][0][f'in_step_zero{z}']['first']:.2f} in the first forward, "
              f"{results[2][0][f'in_step_zero{z}']['peak']:.2f} at most" for z in range(4)]
    with capsys.disabled():
        print("\nworst differences from one process (loss, grad_norm relative; weights absolute):\n"
              + "\n".join(lines) + "\nmodel states at dp=2: " + "; ".join(mem)
              + "\ninside a step of 4 micro-batches, B/param: " + "; ".join(inside))


def test_layouts_data_parallelism_cannot_serve_are_refused_with_the_reason():
    from meshlm.core.config import ConfigError
    from meshlm.core.layout import microbatches_per_step

    with pytest.raises(ConfigError, match="parallel.zero=4 is not a ZeRO stage"):
        H.config(zero=4)
    with pytest.raises(ConfigError, match=r"micro_batch_size=1 × dp=3"):
        microbatches_per_step(H.config(), 3)
