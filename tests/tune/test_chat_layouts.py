"""Chat fine-tuning (`meshlm tune --method full` on conversations, packed: data.document_mask) under torchrun
trains like one process: tensor parallelism (tp = 2, the vocab-parallel loss), two pipeline stages and data
parallelism with ZeRO-1 (dp = 2, parallel.zero=1) each give the one-process run's per-step losses and final
validation loss within 1e-5 (relative). One torchrun of 2 processes per layout, 3 steps of a tiny model."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from meshlm.cli import main
from tests.tune.test_chat_sft import CHAT_MODEL, chat_rows
from tests.tune.tune_helpers import QUIET, metrics, save_base, train_losses, write_jsonl

TOL = 1e-5
STEPS = 3
LAYOUTS = {"tp2": ["--parallel.tp=2"], "pp2": ["--parallel.pp=2"], "dp2_zero1": ["--parallel.zero=1"]}


def args_for(root) -> list[str]:
    return ["tune", "--checkpoint", str(root / "base"), "--method", "full", "--train", str(root / "train.jsonl"),
            "--valid", str(root / "valid.jsonl"), "--pack", *QUIET, f"--train.max_steps={STEPS}",
            "--train.log_every=1", f"--train.eval_every={STEPS}", "--optim.lr=1e-2", "--optim.warmup_steps=1",
            "--parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_layouts")
    save_base(root / "base", CHAT_MODEL)
    write_jsonl(root / "train.jsonl", chat_rows(48, 1))
    write_jsonl(root / "valid.jsonl", chat_rows(12, 2))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args_for(root), "--out", str(root / "one")]) == 0
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chat_sft_layout_matches_one_process(root, layout):
    out = root / layout
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "meshlm",
                           *args_for(root), "--out", str(out), *LAYOUTS[layout]],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = train_losses(root / "one"), train_losses(out)
    assert len(ref) == len(got) == STEPS and ref[-1] < ref[0]
    for a, b in zip(ref, got):
        assert abs(a - b) <= TOL * abs(a), (ref, got)
    assert metrics(out, "eval")[-1]["val_loss"] == pytest.approx(metrics(root / "one", "eval")[-1]["val_loss"],
                                                                 rel=TOL)
