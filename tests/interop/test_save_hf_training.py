"""`train.save_hf`: Hugging Face directories written during training from the checkpoints it publishes
(meshlm/interop/during_training.py), and the tensor-by-tensor writer under them (interop/hf_stream.py).

Each directory must load in `transformers` and give the logits of meshlm's model loaded from the same
checkpoint in one process (within 1e-5): from one process (GPT-2, every N steps), with the conversion in
a background thread (Llama with grouped-query attention, train.async_save, checkpoints pruned under it),
and from the per-rank pieces of a tp2 x pp2 run of 4 processes (torchrun).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interop_helpers import one_error_line, perturbed

from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.commands.train import build_trainer
from meshlm.interop.hf import save_hf
from meshlm.models.gpt import GPT
from tests.checkpoint_helpers import load_run
from tests.conftest import ROOT, tiny_config

transformers = pytest.importorskip("transformers")
TOL = 1e-5
LLAMA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
         "n_kv_heads": 2}


def _same_logits(hf_dir: Path, checkpoint: Path) -> float:
    """Max |logits| difference between `transformers`' model of `hf_dir` and meshlm's of `checkpoint`."""
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours, _, config = load_run(checkpoint)
    cfg = config.model
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return float((hf.eval()(ids).logits - ours(ids)).abs().max())


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_every_n_steps_one_process(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(out, train={"max_steps": 4, "save_every": 1, "save_hf": "every", "save_hf_every": 2})
    build_trainer(cfg).run()
    root = out / "hf_checkpoints"
    assert _steps(root) == ["latest", "step_0000002", "step_0000004"], "steps 2 and 4, not the others"
    assert (root / "latest").resolve() == (root / "step_0000004").resolve()
    assert (root / "latest" / "tokenizer.json").is_file() and (root / "step_0000002" / "vocab.json").is_file()
    for step in (2, 4):
        assert _same_logits(root / f"step_{step:07d}", out / "checkpoints" / f"step_{step:07d}") <= TOL
    assert _same_logits(root / "step_0000002", out / "checkpoints" / "step_0000004") > TOL, "two different models"


def test_background_conversion_llama_gqa_with_pruned_checkpoints(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(out, model=LLAMA, train={"max_steps": 3, "save_every": 1, "keep_last": 1, "async_save": True,
                                                "save_hf": "every", "save_hf_every": 1})
    build_trainer(cfg).run()
    root = out / "hf_checkpoints"
    assert _steps(root) == ["latest", "step_0000001", "step_0000002", "step_0000003"], "no leftover .tmp-*"
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_0000003"], "keep_last=1 pruned"
    assert transformers.AutoConfig.from_pretrained(str(root / "latest")).num_key_value_heads == 2
    assert _same_logits(root / "latest", out / "checkpoints" / "step_0000003") <= TOL


def test_tp2_pp2_run_of_four_processes(tmp_path):
    """The issue's acceptance test: `meshlm train` under torchrun, tp 2 x pp 2, train.save_hf=end."""
    out = tmp_path / "run"
    small = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
             "--train.global_batch_size=4", "--train.eval_iters=1", "--train.eval_every=0", "--train.log_every=1",
             "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false", "--parallel.timeout_s=60",
             "--train.precision=fp32", "--train.max_steps=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", "meshlm", "train",
           "--config", "gpt-tiny", *small, "--parallel.tp=2", "--parallel.pp=2", "--train.save_hf=end",
           f"--train.out_dir={out}"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote Hugging Face directory") == 1, "rank 0 converts, once"
    source = resolve_checkpoint(out)
    assert (source / "index.json").exists() and not (source / "model.pt").exists(), "per-rank pieces"
    assert _steps(out / "hf_checkpoints") == ["latest", "step_0000002"]
    assert _same_logits(out / "hf_checkpoints" / "latest", out) <= TOL


def test_bad_values_are_one_line_before_training(tmp_path):
    run = ["train", "--config", "gpt-tiny", f"--train.out_dir={tmp_path / 'run'}"]
    one_error_line([*run, "--train.save_hf=yes"], "train.save_hf", "end", "every")
    one_error_line([*run, "--train.save_hf=every"], "train.save_hf", "train.save_every")
    one_error_line([*run, "--train.save_hf=every", "--train.save_every=2", "--train.save_hf_every=3"],
                   "train.save_hf_every=3", "multiple")
    one_error_line([*run, "--train.save_hf_every=2"], "train.save_hf_every", "train.save_hf=every")
    one_error_line([*run, "--train.save_hf=end", "--model.norm=rmsnorm"], "train.save_hf", "model.norm")
    assert not (tmp_path / "run").exists(), "refused before anything is written"


def test_sharded_weights_load_in_transformers(tmp_path):
    """Above max_shard_bytes the weights are split into files with an index, as save_pretrained does."""
    cfg = tiny_config(tmp_path, model=LLAMA).model
    model = perturbed(GPT(cfg))
    save_hf(model, tmp_path / "hf", max_shard_bytes=200_000)
    files = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    hf, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert float((hf.eval()(ids).logits - model(ids)).abs().max()) <= TOL
