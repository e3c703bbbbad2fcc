"""Sharded checkpoints keep the model's persistent buffers: a sigmoid router's `score_bias` (checkpoint/sharded.py).

The bias is no parameter (no optimizer steps it: `update_router_bias` adds rate · sign(mean load − load) after
each step), so sharded checkpoints, which stored parameters and optimizer state only, lost it: a resumed run
restarted it at zero, and `convert --to-hf` of the checkpoint failed for want of it. Here a DeepSeek-V3-shaped
model (MLA, a sigmoid router, a shared expert) trains in float64 (dp_harness) 1 step under tp2, is saved,
resumed under dp2 × ep2 for 2 steps, saved, resumed under pp2 (each stage writes its own layer's bias) for
2 steps, saved, and resumed in one process for a sixth step (the biases nonzero at every save). After every resume the biases equal the
uninterrupted one-process run's exactly (sums of ±rate), and every step's loss, gradient norm and weights
match it within dp_harness.TOL. The last checkpoint also assembles in one process (`full_model_state`,
`load_model`) and converts to Hugging Face DeepSeek-V3 with the bias as `e_score_correction_bias`. A
checkpoint written before buffers were saved still loads: the bias stays at zero, said once. A one-process
checkpoint read as logical tensors (how any layout resumes it) gives its bias back too.
"""

from __future__ import annotations

import json
from pathlib import Path

import dp_harness as H
import pytest
import torch
from parallel_world import run_world

from meshlm.checkpoint import sharded
from meshlm.checkpoint.load import Checkpoint, load_model
from meshlm.families.registry import get_spec
from meshlm.models.moe import moe_layers, set_aux_grad_scale, update_router_bias
from meshlm.parallel.mesh import ParallelDims
from meshlm.train.metrics import moe_groups

MODEL = "deepseek_buffers"
H.MODELS.setdefault(MODEL, {**{k: v for k, v in H.MODELS["llama"].items() if k != "n_kv_heads"},
                            "attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                            "qk_rope_head_dim": 4, "v_head_dim": 6, "moe_experts": 4, "moe_top_k": 2,
                            "moe_expert_hidden": 24, "moe_shared_experts": 1, "moe_router": "sigmoid",
                            "moe_bias_rate": 0.01})
# (saved under, name, tp, pp, dp, ep, steps): each stage resumes the checkpoint of the one before it
# (odd step counts at the saves: with 4 experts the bias often returns to 0 after an even number of steps)
STAGES = [("tp2", 2, 1, 1, 1, 1), ("dp2_ep2", 1, 1, 2, 2, 2), ("pp2", 1, 2, 1, 1, 2)]
TOTAL = sum(s[-1] for s in STAGES) + 1  # and one step in one process
SPEC = get_spec("gpt")
_REF: dict = {}  # the uninterrupted one-process run, computed before the world is forked


def _biases(model) -> dict[str, torch.Tensor]:
    return {f"{name}.router.score_bias": m.router.score_bias.clone() for name, m in moe_layers(model)}


def _steps(run, n: int, dims) -> None:
    """The trainer's MoE steps: aux gradients scaled by 1 / micro-batches, the biases updated after each."""
    set_aux_grad_scale(run.model, 1.0 / run.m)
    groups = moe_groups(dims, False) if dims is not None else []
    for _ in range(n):
        H.step(run)
        update_router_bias(run.model, groups)


def _reference() -> dict:
    run = H.build_run(H.config(MODEL), None)
    states, biases = {}, {}
    for n in range(1, TOTAL + 1):
        _steps(run, 1, None)
        states[n], biases[n] = H.full_state(run), _biases(run.model)
    return {"losses": run.losses, "norms": run.norms, "states": states, "biases": biases}


def _bias_error(run) -> float:
    """Largest difference of this rank's biases from the reference's after the same number of steps."""
    want = _REF["biases"][len(run.losses)]
    return max((float((b - want[n]).abs().max()) for n, b in _biases(run.model).items()), default=0.0)


def _world(rank: int, world: int, out_dir: str) -> dict:
    out, path = {}, None
    with H.float64():
        for name, tp, pp, dp, ep, steps in STAGES:
            cfg = H.config(MODEL, tp=tp, pp=pp, dp=dp, ep=ep)
            dims = ParallelDims.build(tp=tp, pp=pp, dp=dp, ep=ep, timeout_s=60)
            if path is None:
                run = H.build_run(cfg, dims)
                resumed_bias = 0.0
            else:
                run = H.resume(cfg, dims, path)
                resumed_bias = _bias_error(run)
            _steps(run, steps, dims)
            got = H.compare(_REF, run)
            path = H.save(run, Path(out_dir) / name, cfg.to_dict())
            out[name] = {"resumed_bias": resumed_bias, "bias": _bias_error(run), "loss": got["loss"],
                         "grad_norm": got["grad_norm"], "weights": got["weights"], "path": str(path),
                         "n_biases": len(_biases(run.model))}
    return out


def test_router_bias_survives_resharded_resumes_and_exports(tmp_path):
    with H.float64(), H.one_thread():
        _REF.update(_reference())
    saves = [sum(s[-1] for s in STAGES[:i + 1]) for i in range(len(STAGES))]
    assert all(max(float(b.abs().max()) for b in _REF["biases"][n].values()) > 0 for n in saves)  # bias moved
    results = run_world(_world, 2, tmp_path / "world")
    for name, *_ in STAGES:
        for rank in results:
            got = rank[name]
            assert got["resumed_bias"] == 0.0 and got["bias"] == 0.0, (name, got)
            assert max(got["loss"], got["grad_norm"], got["weights"]) < H.TOL, (name, got)
    assert [r["pp2"]["n_biases"] for r in results] == [1, 1], "each pipeline stage holds its own layer's bias"
    last = Path(results[0]["pp2"]["path"])
    cfg = H.config(MODEL)
    with H.float64(), H.one_thread():
        run = H.resume(cfg, None, last)
        assert _bias_error(run) == 0.0
        _steps(run, 1, None)
        got = H.compare(_REF, run)
        assert _bias_error(run) == 0.0 and len(run.losses) == TOTAL
        assert max(got["loss"], got["grad_norm"], got["weights"]) < H.TOL, got
    want = _REF["biases"][TOTAL - 1]
    state = sharded.full_model_state(last, cfg.model, spec=SPEC)
    assert all(torch.equal(state[n], b) for n, b in want.items())
    model = load_model(Checkpoint(str(last), last, cfg, True), SPEC, log=None)
    assert all(torch.equal(b, want[n]) for n, b in _biases(model).items())
    assert "rope_cos" not in state, "computed buffers stay out of checkpoints"
    _exports_bias_to_hf(last, want, tmp_path / "hf")


def _exports_bias_to_hf(path: Path, want: dict, out: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from meshlm.cli import main

    assert main(["convert", "--checkpoint", str(path), "--to-hf", str(out)]) in (0, None)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(out))
    for i in range(2):
        got = hf.model.layers[i].mlp.gate.e_score_correction_bias
        assert torch.equal(got.to(torch.float32), want[f"layers.{i}.mlp.router.score_bias"])


def _old_format(path: Path) -> None:
    """Rewrite `path`'s index as a checkpoint from before buffers were saved: no buffer pieces."""
    index = json.loads((path / "index.json").read_text())
    index["chunks"] = [c for c in index["chunks"] if "score_bias" not in c[3]]
    (path / "index.json").write_text(json.dumps(index))


def test_a_checkpoint_without_buffers_still_loads_and_says_so(tmp_path):
    cfg = H.config(MODEL)
    run = H.build_run(cfg, None)
    _steps(run, 2, None)
    assert any(float(b.abs().max()) > 0 for b in _biases(run.model).values())
    path = H.save(run, tmp_path / "run", cfg.to_dict())
    _old_format(path)
    fresh, lines = H.build_run(cfg, None), []
    sharded.load(path, fresh.sync, fresh.opt, spec=SPEC, log=lines.append)
    assert len(lines) == 1 and "no buffers" in lines[0] and "score_bias" in lines[0], lines
    assert all(float(b.abs().max()) == 0 for b in _biases(fresh.model).values())
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), run.model.parameters()))
    notes = []
    model = load_model(Checkpoint(str(path), path, cfg, True), SPEC, log=notes.append)
    assert len(notes) == 1 and all(float(b.abs().max()) == 0 for b in _biases(model).values())


def test_a_one_process_checkpoint_gives_its_bias_to_the_logical_reader(tmp_path):
    """A one-process run's `model.pt` holds the bias (its state dict): resumed through the logical tensors (as
    any parallel layout reads it), the bias comes back too."""
    from meshlm.checkpoint.single import save_checkpoint

    cfg = H.config(MODEL)
    run = H.build_run(cfg, None)
    _steps(run, 1, None)
    path = save_checkpoint(tmp_path / "run", 1, {"model": run.model.state_dict(), "optim": run.opt.state_dict()},
                           cfg.to_dict())
    fresh, lines = H.build_run(cfg, None), []
    sharded.load(path, fresh.sync, fresh.opt, spec=SPEC, log=lines.append)
    want = _biases(run.model)
    assert not lines and max(float(b.abs().max()) for b in want.values()) > 0
    assert all(torch.equal(b, want[n]) for n, b in _biases(fresh.model).items())
