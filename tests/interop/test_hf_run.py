"""An imported GPT-2 is a run directory like any other: `meshlm generate` samples from it and `meshlm train`
resumes it (train.resume=auto on its out_dir), starting from the imported weights. Run as a user runs
the commands (console scripts)."""

from __future__ import annotations

import pytest
import torch

from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
from tests.conftest import run_cli

transformers = pytest.importorskip("transformers")
SMALL = ["--model.n_layers=2", "--model.hidden_size=32", "--model.n_heads=4", "--model.seq_len=32",
         "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.eval_iters=1", "--train.eval_every=0",
         "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false", "--optim.lr=1e-4",
         "--optim.min_lr=1e-5", "--optim.warmup_steps=0"]


def test_imported_gpt2_generates_and_resumes_training(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(tmp_path / "hf"))
    run = tmp_path / "run"
    proc = run_cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "data.tokenizer='gpt2'" in proc.stderr  # the note: no tokenizer files, the bundled one recorded

    gen = run_cli("generate", "--checkpoint", str(run), "--prompt", "ROMEO.", "--max-new-tokens", "5", "--seed", "1",
                  timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO.")

    train = run_cli("train", "--config", "gpt-tiny", *SMALL, "--train.max_steps=1", f"--train.out_dir={run}",
                    timeout=240)
    assert train.returncode == 0, train.stderr
    assert "at step 0" in train.stdout, train.stdout
    imported = load_model_state(run / "checkpoints" / "step_0000000")
    trained = load_model_state(resolve_checkpoint(run))
    assert resolve_checkpoint(run).name == "step_0000001"
    moved = max(float((trained[k] - v).abs().max()) for k, v in imported.items())
    assert 0 < moved < 1e-3, "one AdamW step of lr 1e-4 from the imported weights, not a fresh start"
