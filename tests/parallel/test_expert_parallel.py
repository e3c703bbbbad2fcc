"""Expert parallelism (meshlm/parallel/expert.py) against one process, in float64 (dp_harness).

Training (2 clipped AdamW steps of 8 micro-batches of one row): ep2 (dp2), ep4 (dp4), ep2 inside dp4 (the
experts' gradients also reduced over their expert-data-parallel pair), with ZeRO-1 and ZeRO-2, ep2 × tp2
(with and without SP; and tp2 + SP at ep 1), ep2 × pp2, ep2 × cp2 (ep carved from the cp ranks), ep2 with
full recomputation, and capacity dropping under ep2 and ep4: losses, gradient norms and the final weights
(the experts gathered over ep) within dp_harness.TOL of one process. The MoE model has a shared expert with
its gate. Under SP (cp) each tp (cp) rank's aux losses are those of its sequence shard (chunks), so those
layouts run without them (the LM gradients are then exact). Capacity is decided per micro-batch on the rank
that routes it, and every capacity layout here routes the same micro-batches as one process: the drops are
the same ones (the test checks there are some). Checkpoints: ep2 → one process, one process → ep2, ep4
ZeRO-1 → dp4 × ep2 ZeRO-2. The refused layouts. The torchrun run (about 30 s on 2 cores: two launches of the
trainer) is the one check of the trainer's own path: aux-loss scaling, metrics and its checkpoint.
"""

from __future__ import annotations

import dp_harness as H
import pytest
import torch
from parallel_world import run_world

from meshlm.families.registry import get_spec
from meshlm.parallel.mesh import ParallelDims

STEPS, HALF = 2, 1
GPT_SPEC = get_spec("gpt")  # every run here is of the gpt family (its pieces need the spec)

MOE = {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16, "vocab_size": 101,
       "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
       "moe_experts": 4, "moe_top_k": 2, "moe_expert_hidden": 24, "moe_shared_experts": 1, "moe_shared_gate": True,
       "moe_aux_loss": 0.05, "moe_z_loss": 0.01}
H.MODELS.setdefault("moe", MOE)
H.MODELS.setdefault("moe_cap", {**MOE, "moe_capacity_factor": 0.5, "moe_shared_experts": 0, "moe_shared_gate": False})
H.MODELS.setdefault("moe_noaux", {**MOE, "moe_aux_loss": 0.0, "moe_z_loss": 0.0})
# name: (model, tp, pp, dp, ep, zero, extra), by world size
LAYOUTS = {
    2: {"ep2": ("moe", 1, 1, 2, 2, 0, {}), "ep2_zero1": ("moe", 1, 1, 2, 2, 1, {}),
        "ep2_capacity": ("moe_cap", 1, 1, 2, 2, 0, {}), "ep2_cp2": ("moe_noaux", 1, 1, 1, 2, 0, {"cp": 2}),
        "ep2_full_recompute": ("moe", 1, 1, 2, 2, 0, {"train": {"recompute": "full"}})},
    4: {"ep4": ("moe", 1, 1, 4, 4, 0, {}), "ep4_capacity": ("moe_cap", 1, 1, 4, 4, 2, {}),
        "dp4_ep2": ("moe", 1, 1, 4, 2, 0, {}), "dp4_ep2_zero2": ("moe", 1, 1, 4, 2, 2, {}),
        "ep2_tp2": ("moe", 2, 1, 2, 2, 0, {}), "ep2_tp2_sp": ("moe_noaux", 2, 1, 2, 2, 1, {"sp": True}),
        "ep2_pp2": ("moe", 1, 2, 2, 2, 0, {}),
        # ep 1 under tp2 + SP: the MoE parameters saw each rank's sequence shard, their gradients summed over tp
        "tp2_sp": ("moe_noaux", 2, 1, 2, 1, 0, {"sp": True})},
}
_REFS: dict = {}
_build_run = H.build_run


def _build_moe_run(cfg, dims, consumed: int = 0):
    """dp_harness's run with the aux losses' gradients scaled as the trainer scales them (1 / micro-batches)."""
    from meshlm.models.moe import set_aux_grad_scale

    run = _build_run(cfg, dims, consumed)
    set_aux_grad_scale(run.model, 1.0 / run.m)
    return run


H.build_run = _build_moe_run  # (a no-op for models without MoE layers)


def _train_world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (model, tp, pp, dp, ep, zero, extra) in LAYOUTS[world].items():
            extra = dict(extra)
            cfg = H.config(model, tp=tp, pp=pp, dp=dp, zero=zero, ep=ep, train=extra.pop("train", None), **extra)
            dims = ParallelDims.build(tp=tp, pp=pp, dp=dp, cp=extra.get("cp", 1), ep=ep, timeout_s=60)
            assert (dims.ep, dims.edp) == (ep, dims.dpcp // ep)
            run = H.train(cfg, dims, STEPS)
            sizes = {tuple(p.shape) for n, p in run.model.named_parameters() if n.endswith("experts.fc")}
            out[name] = {**H.compare(_REFS[model], run), "expert_shapes": sizes}
    return out


def _dropped(model: str) -> float:
    """The share of assignments capacity drops in the reference's first forward."""
    from meshlm.families.registry import get_spec
    from meshlm.models.moe import moe_layers

    cfg = H.config(model)
    torch.manual_seed(H.SEED)
    ref = get_spec("gpt").model_class(cfg.model)
    x, _ = H.build_run(cfg, None).loader.next()
    ref(x)
    stats = [m.take_stats() for _, m in moe_layers(ref)]
    return sum(float(s["dropped"]) for s in stats) / sum(float(s["counts"].sum()) for s in stats)


def test_training_under_ep_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        _REFS.update({m: H.reference(m, STEPS) for m in ("moe", "moe_cap", "moe_noaux")})
        assert _dropped("moe_cap") > 0.1  # capacity really drops assignments
    seen = []
    for world in LAYOUTS:
        for rank_result in run_world(_train_world, world, tmp_path / f"world{world}"):
            seen += rank_result.items()
    assert sorted({name for name, _ in seen}) == sorted(n for layouts in LAYOUTS.values() for n in layouts)
    bad = [(name, got["loss"], got["grad_norm"], got["weights"]) for name, got in seen
           if not (got["loss"] < H.TOL and got["grad_norm"] < H.TOL and got["weights"] < H.TOL)]
    assert not bad, bad
    for name, got in seen:
        ep = next(layouts[name][4] for layouts in LAYOUTS.values() if name in layouts)
        assert got["expert_shapes"] == {(4 // ep, 48, 32)}, (name, got["expert_shapes"])  # E/ep experts held
        assert got["loss"] < H.TOL and got["grad_norm"] < H.TOL and got["weights"] < H.TOL, (name, got)


# ---- checkpoints reshard across ep ---------------------------------------------------------------------------
RESHARD = {"one_to_ep2": (None, (2, 2, 0)), "ep2_to_one": ((2, 2, 0), None),
           "ep4_zero1_to_dp4_ep2": ((4, 4, 1), (4, 2, 2))}


def _layout_run(layout, path=None):
    """(dp, ep, zero) → this rank's run of it (None: one process), fresh or resumed from `path`."""
    if layout is None:
        cfg, dims = H.config("moe"), None
    else:
        dp, ep, zero = layout
        cfg, dims = H.config("moe", dp=dp, ep=ep, zero=zero), ParallelDims.build(dp=dp, ep=ep, timeout_s=60)
    return H.resume(cfg, dims, path) if path is not None else H.build_run(cfg, dims)


def _reshard_world(rank: int, world: int, out_dir: str) -> dict:
    from meshlm.checkpoint.single import resolve_checkpoint

    out = {}
    with H.float64():
        for name, (first, second) in RESHARD.items():
            root = f"{out_dir}/../{name}"
            if first is not None and first[0] == world:
                run = _layout_run(first)
                for _ in range(HALF):
                    H.step(run)
                H.save(run, root, {})
            if second is not None and second[0] == world:
                run = _layout_run(second, path=resolve_checkpoint(root))
                for _ in range(HALF):
                    H.step(run)
                out[name] = H.compare(_REFS["moe2"], run)
    return out


def test_checkpoints_reshard_across_ep(tmp_path):
    """ep2 → one process, one process → ep2, ep4 ZeRO-1 → dp4 × ep2 ZeRO-2: the losses and the final weights
    as 2 uninterrupted steps of one process (the experts saved as whole (E, …) logical tensors)."""
    from meshlm.checkpoint.single import resolve_checkpoint

    with H.float64(), H.one_thread():
        _REFS["moe2"] = H.reference("moe", 2 * HALF)
        first = _layout_run(None)
        for _ in range(HALF):
            H.step(first)
        H.save(first, tmp_path / "one_to_ep2", {})
    results = run_world(_reshard_world, 2, tmp_path / "world2")
    results += run_world(_reshard_world, 4, tmp_path / "world4")
    with H.float64(), H.one_thread():
        run = _layout_run(None, path=resolve_checkpoint(tmp_path / "ep2_to_one"))
        for _ in range(HALF):
            H.step(run)
        results.append({"ep2_to_one": H.compare(_REFS["moe2"], run)})
    names = [name for r in results for name in r]
    assert sorted(set(names)) == sorted(RESHARD) and len(names) == 2 + 4 + 1
    for r in results:
        for name, got in r.items():
            assert len(got["losses"]) == 2 * HALF, name
            assert got["loss"] < H.TOL and got["weights"] < H.TOL, (name, got)


# ---- refused layouts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys, words", [
    ({"parallel": {"ep": 3}, "model": MOE}, "parallel.ep=3"),
    ({"parallel": {"ep": 2}, "model": {**MOE, "moe_experts": 0}}, "model.moe_experts=0"),
    ({"parallel": {"ep": 2, "zero": 3}, "model": MOE}, "parallel.zero=3 with parallel.ep=2"),
    ({"parallel": {"ep": 0}, "model": MOE}, "parallel.ep=0 must be >= 1"),
])
def test_bad_ep_is_refused_with_one_line(keys, words):
    from meshlm.core.config import build
    from meshlm.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        build(keys)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_ep_must_divide_the_replicas():
    from meshlm.core.config import build
    from meshlm.core.errors import ConfigError
    from meshlm.core.layout import plan_layout

    cfg = build({"parallel": {"ep": 4}, "model": MOE, "train": {"global_batch_size": 8, "micro_batch_size": 1}})
    with pytest.raises(ConfigError, match="dp × cp = 2"):
        plan_layout(cfg, 1, 2, 1)
    assert plan_layout(cfg, 1, 4, 1).dp == 4


# ---- the trainer under torchrun ----------------------------------------------------------------------------------
def test_torchrun_ep2_matches_single_process(tmp_path):
    """`torchrun --nproc_per_node=2 -m meshlm train --config gpt-moe-tiny --parallel.ep=2` (gloo, fp32, ZeRO-1,
    a small shape): the layout line, the same per-step and evaluation losses and the same final weights (read
    from its checkpoint, the experts gathered from both ranks' pieces) as one process with the same keys."""
    import json
    import subprocess
    import sys

    from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
    from meshlm.core.config import load_config
    from meshlm.train.trainer import Trainer
    from tests.conftest import ROOT

    small = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--model.moe_expert_hidden=48",
             "--model.moe_experts=4", "--train.micro_batch_size=2", "--train.global_batch_size=4",
             "--train.eval_iters=1", "--train.eval_every=2", "--train.log_every=1", "--train.peak_tflops=1",
             "--train.sample_tokens=0", "--train.progress=false", "--train.max_steps=2", "--train.precision=fp32"]
    out, ref = tmp_path / "ep2", tmp_path / "one"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "meshlm", "train",
           "--config", "gpt-moe-tiny", "--parallel.ep=2", "--parallel.zero=1", *small, "--parallel.timeout_s=60",
           f"--train.out_dir={out}"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "; ep 2 (2 experts per rank, all-to-all)" in proc.stdout
    Trainer(load_config("gpt-moe-tiny", small + [f"--train.out_dir={ref}"])).run()
    metrics = lambda d: [(r["kind"], r.get("loss", r.get("val_loss"))) for r in
                         map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if r["kind"] in ("train", "eval")]
    got, want = metrics(out), metrics(ref)
    assert [k for k, _ in got] == [k for k, _ in want] and len(got) == 3, (got, want)
    assert max(abs(a - b) / b for (_, a), (_, b) in zip(got, want)) < 1e-5, (got, want)
    full, plain = (load_model_state(resolve_checkpoint(d), spec=GPT_SPEC) for d in (out, ref))
    assert full.keys() == plain.keys() and full["layers.0.mlp.experts.fc"].shape == (4, 96, 32)
    assert max(float((full[k] - v).abs().max()) for k, v in plain.items()) < 1e-5
