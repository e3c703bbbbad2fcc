"""`torchrun … meshlm tune` with LoRA on multi-head latent attention (models/mla.py `lora_targets`) under tp2 + SP
trains like one process. MLA's linears split unlike the fused qkv: `q_b_proj`/`kv_b_proj` (q_up, kv_up) are
column-parallel by heads, `o` (proj) row-parallel, and `q_a_proj`/`kv_a_proj_with_mqa` (the down projections)
replicated, every rank computing them whole on the gathered sequence, so their LoRA is a plain one on each rank
whose gradients are whole because what follows is column-parallel (and the rope key's summed over tp). Per-step
losses and the final evaluation within 1e-5 (relative), the saved adapter equal to the one-process one (1e-3 of
each tensor's scale, as tests/parallel/test_tune_parallel.py explains)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest
import torch

from meshlm.checkpoint.files import load_torch
from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.cli import main
from tests.tune.tune_helpers import LLAMA, QUIET, metrics, repeat_rows, save_base, train_losses, write_jsonl

TOL = 1e-5
STEPS = 4
MLA = {**{k: v for k, v in LLAMA.items() if k != "n_kv_heads"}, "attention": "mla", "q_lora_rank": 12,
       "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
TARGETS = "--tune.lora_targets=['q_a_proj','q_b_proj','kv_a_proj_with_mqa','kv_b_proj','o','down']"


def args(root) -> list[str]:
    return ["tune", "--checkpoint", str(root / "mla"), "--method", "lora", "--train", str(root / "train.jsonl"),
            "--valid", str(root / "valid.jsonl"), *QUIET, f"--train.max_steps={STEPS}", "--train.log_every=1",
            "--optim.lr=2e-2", "--optim.warmup_steps=1", "--parallel.timeout_s=60", "--max-length", "16", TARGETS]


def test_mla_lora_under_tp2_sp_matches_one_process(tmp_path):
    save_base(tmp_path / "mla", MLA)
    write_jsonl(tmp_path / "train.jsonl", repeat_rows(32, 1))
    write_jsonl(tmp_path / "valid.jsonl", repeat_rows(8, 2))
    one, out = tmp_path / "one", tmp_path / "tp2_sp"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args(tmp_path), "--out", str(one)]) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "meshlm",
                           *args(tmp_path), "--out", str(out), "--parallel.tp=2", "--parallel.sp=true"],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = train_losses(one), train_losses(out)
    assert len(ref) == len(got) == STEPS and ref[-1] < ref[0]
    for a, b in zip(ref, got):
        assert abs(a - b) <= TOL * abs(a), (ref, got)
    assert metrics(out, "eval")[-1]["val_loss"] == pytest.approx(metrics(one, "eval")[-1]["val_loss"], rel=TOL)
    a, b = (load_torch(resolve_checkpoint(run, log=None) / "model.pt") for run in (one, out))
    assert set(a) == set(b) and {k.split(".lora.")[0].split(".")[-1] for k in a} == \
        {"q_down", "q_up", "kv_down", "kv_up", "proj"}
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-3 * float(a[key].abs().max()),
                                   msg=lambda m, key=key: f"{key}: {m}")
