"""A family defined only in the tests (`toy_family.py`: a post-LN bidirectional encoder, no GPT names)
trains through the registry under tp=2 (with sequence parallelism and selective recomputation) and pp=2
(with full recomputation) exactly as in one process.

Each run is the real `Trainer` (meta-device build, the family's plans, layout-free checkpoints) on the
bundled corpus: 4 AdamW steps, fp32, no dropout. Per-step losses agree within 1e-5 relative and the final
weights (read back whole from the checkpoint's pieces) within 1e-5. AdamW's eps is 1e-6 here, not 1e-8:
an element whose gradient is at the level of fp32 rounding gets an update of ±lr whose sign rounding
decides when eps is far below that gradient, so no weight tolerance under lr would hold on every CPU;
with eps = 1e-6 such an update is at most lr·|g|/eps, below the tolerance (docs/reliability.md).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import toy_family  # noqa: F401 (registers the family, here and in the spawned workers)
from parallel_world import run_world

from meshlm.checkpoint.single import latest_checkpoint, load_model_state
from meshlm.core.config import build
from meshlm.families.registry import get_spec
from meshlm.parallel import ParallelDims, build_model
from meshlm.train.trainer import Trainer

TOL = 1e-5
LAYOUTS = {"tp2_sp_selective": ({"tp": 2, "sp": True}, "selective"), "pp2_full": ({"pp": 2}, "full")}


def _config(out: Path, parallel: dict | None = None, recompute: str = "none"):
    return build({
        "model": {"family": "toy-encoder", "n_layers": 4, "hidden_size": 32, "n_heads": 4, "seq_len": 16,
                  "vocab_size": 50257},
        "train": {"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "out_dir": str(out),
                  "log_every": 1, "eval_every": 0, "eval_iters": 1, "progress": False, "peak_tflops": 1.0,
                  "sample_tokens": 0, "recompute": recompute},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "eps": 1e-6},
        "parallel": {**(parallel or {}), "timeout_s": 60},
    })


def _train(name: str, rank: int, world: int, out_dir: str) -> None:
    parallel, recompute = LAYOUTS[name]
    Trainer(_config(Path(out_dir) / "run", parallel, recompute)).run()


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "single"
    Trainer(_config(out)).run()
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_toy_family_trains_like_one_process(reference, tmp_path, name):
    run_world(functools.partial(_train, name), 2, tmp_path, deadline_s=240)
    want, got = _losses(reference), _losses(tmp_path / "run")
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        assert abs(a - b) <= TOL * abs(b), f"{name}: losses {got} vs {want}"
    assert want[-1] < want[0], "the family should learn in 4 steps"
    spec = get_spec(_config(Path("unused")).model.family)
    mine = load_model_state(latest_checkpoint(tmp_path / "run"), spec=spec)
    ref = load_model_state(latest_checkpoint(reference), spec=spec)
    assert mine.keys() == ref.keys()
    worst = max(float((mine[k] - ref[k]).abs().max()) for k in ref)
    assert worst <= TOL, f"{name}: final weights off by {worst:.2e}"


def test_toy_family_has_no_gpt_names():
    """The toy model's parameters share no name with GPT's: the transforms found them through the spec."""
    cfg = _config(Path("unused"))
    model = build_model(cfg, ParallelDims(pp=1, dp=1, tp=2, rank=1), spec=get_spec(cfg.model.family)).model  # no group
    names = [n for n, _ in model.named_parameters()]
    assert not any(w in n for n in names for w in ("tok_emb", "lm_head", "layers.", "qkv", "mlp"))
    assert type(model.blocks[0].attn.in_proj).__name__ == "ColumnParallelLinear"
    assert type(model.out).__name__ == "ColumnParallelLinear" and model.out.weight.shape[0] == -(-50257 // 2)
