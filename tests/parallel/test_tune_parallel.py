"""`torchrun … meshlm tune` under a parallel layout trains like one process: per-step losses and the final
evaluation within 1e-5 (relative), and the saved adapter (whole tensors gathered from the tp ranks and
pipeline stages) equal to the one-process adapter (within 1e-3 of each tensor's scale: see below). LoRA on tensor-parallel linears with and
without sequence parallelism (GPT-2: q, v rows of the fused column-parallel qkv, the row-parallel o and
down, the column-parallel MLP input; Llama with GQA: every target, SwiGLU's halves included), prompt
tuning under tp + SP and under pp = 2, p-tuning under dp = 2. Dropout is off, as in the other equivalence
tests."""

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
STEPS = 5
COMMON = [*QUIET, f"--train.max_steps={STEPS}", "--train.log_every=1", "--optim.lr=2e-2", "--optim.warmup_steps=1",
          "--parallel.timeout_s=60", "--max-length", "16"]
REFERENCES = {"lora_gpt2": ("base", "lora", ["--tune.lora_targets=['q','v','o','up','down']"]),
              "lora_llama": ("llama", "lora", ["--tune.lora_targets=['q','k','v','o','gate','up','down']"]),
              "prompt": ("base", "prompt", ["--tune.virtual_tokens=4"]),
              "ptuning": ("base", "ptuning", ["--tune.virtual_tokens=4"])}
LAYOUTS = {"lora_gpt2_tp2_sp": ("lora_gpt2", ["--parallel.tp=2", "--parallel.sp=true"]),
           "lora_llama_tp2": ("lora_llama", ["--parallel.tp=2"]),
           "prompt_tp2_sp": ("prompt", ["--parallel.tp=2", "--parallel.sp=true"]),
           "prompt_pp2": ("prompt", ["--parallel.pp=2"]),
           "ptuning_dp2": ("ptuning", [])}


def args_for(root, name: str) -> list[str]:
    base, method, extra = REFERENCES[name]
    return ["tune", "--checkpoint", str(root / base), "--method", method, "--train", str(root / "train.jsonl"),
            "--valid", str(root / "valid.jsonl"), *COMMON, *extra]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune_parallel")
    save_base(root / "base")
    save_base(root / "llama", LLAMA)
    write_jsonl(root / "train.jsonl", repeat_rows(64, 1))
    write_jsonl(root / "valid.jsonl", repeat_rows(13, 2))
    for name in REFERENCES:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main([*args_for(root, name), "--out", str(root / f"{name}_one")]) == 0
    return root


def adapter(run) -> dict[str, torch.Tensor]:
    return load_torch(resolve_checkpoint(run, log=None) / "model.pt")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(root, layout):
    ref_name, flags = LAYOUTS[layout]
    out = root / layout
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "meshlm",
                           *args_for(root, ref_name), "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = root / f"{ref_name}_one"
    ref, got = train_losses(one), train_losses(out)
    assert len(ref) == len(got) == STEPS
    assert ref[-1] < ref[0]
    for a, b in zip(ref, got):
        assert abs(a - b) <= TOL * abs(a), (ref, got)
    ref_eval, got_eval = metrics(one, "eval")[-1], metrics(out, "eval")[-1]
    assert got_eval["val_loss"] == pytest.approx(ref_eval["val_loss"], rel=TOL)
    a, b = adapter(one), adapter(out)
    assert set(a) == set(b) and a
    for key in a:
        assert a[key].shape == b[key].shape, key
        # Adam divides by √v: an element whose gradient is near zero moves by up to lr on rounding noise alone,
        # so the weights are compared at 1e-3 of their scale (the losses above are the 1e-5 claim).
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-3 * float(a[key].abs().max()),
                                   msg=lambda m, key=key: f"{key}: {m}")
