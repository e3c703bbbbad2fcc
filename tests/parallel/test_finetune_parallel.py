"""`torchrun … meshlm finetune` under a parallel layout trains like one process: the per-step losses within
1e-5 (relative) and the same evaluation metrics, for a span task under tp=2 with sequence parallelism (the
per-token head reads the gathered sequence) and a classify task under dp=2 (each rank a slice of every
batch; the loss parts summed over dp). Dropout is off, as in the other equivalence tests: its masks come
from per-rank streams."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from meshlm.cli import main
from tests.train.finetune_helpers import (
    QUIET,
    classify_rows,
    eval_rows,
    save_base,
    span_rows,
    train_losses,
    write_jsonl,
)

TOL = 1e-5
STEPS = 6
COMMON = [*QUIET, f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.global_batch_size=16",
          "--train.micro_batch_size=8", "--optim.lr=1e-2", "--optim.warmup_steps=1", "--model.dropout=0",
          "--parallel.timeout_s=60"]
LAYOUTS = {"span_tp2_sp": ("span", span_rows, ["--parallel.tp=2", "--parallel.sp=true"]),
           "classify_dp2": ("classify", classify_rows, [])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ft_parallel")
    base = save_base(root / "base")
    out = {}
    for name, (task, rows, layout) in LAYOUTS.items():
        train = write_jsonl(root / f"{name}_train.jsonl", rows(48, seed=1))
        valid = write_jsonl(root / f"{name}_valid.jsonl", rows(11, seed=2))
        args = ["finetune", "--checkpoint", str(base), "--task", task, "--train", str(train), "--valid", str(valid),
                *COMMON]
        with contextlib.redirect_stdout(io.StringIO()):
            assert main([*args, "--out", str(root / f"{name}_one")]) == 0
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "meshlm",
                               *args, "--out", str(root / name), *layout],
                              capture_output=True, text=True, timeout=150, check=False)
        out[name] = (proc, root / f"{name}_one", root / name)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(runs, name):
    proc, one, parallel = runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step      1 |") == 1  # rank 0 alone logs
    ref, got = train_losses(one), train_losses(parallel)
    assert len(ref) == len(got) == STEPS
    assert ref[-1] < ref[0]  # the weights moved: the comparison is not of a frozen model
    for a, b in zip(ref, got):
        assert abs(a - b) <= TOL * abs(a), (ref, got)
    ref_eval, got_eval = eval_rows(one)[-1], eval_rows(parallel)[-1]
    metrics = [k for k in ref_eval if k.startswith("val_")]
    assert len(metrics) == 3  # val_loss and the task's two metrics
    for key in metrics:
        assert got_eval[key] == pytest.approx(ref_eval[key], rel=TOL, abs=1e-6), key


def test_pipeline_layout_evaluates(runs, tmp_path):
    _, one, _ = runs["classify_dp2"]
    root = one.parent
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "meshlm",
                           "finetune", "--checkpoint", str(root / "base"), "--task", "classify", "--train",
                           str(root / "classify_dp2_train.jsonl"), "--valid", str(root / "classify_dp2_valid.jsonl"),
                           *COMMON, "--out", str(tmp_path / "pp2"), "--parallel.pp=2"],
                          capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref, got = train_losses(one), train_losses(tmp_path / "pp2")
    assert all(abs(a - b) <= TOL * abs(a) for a, b in zip(ref, got, strict=True)), (ref, got)
