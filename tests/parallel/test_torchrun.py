"""`torchrun … -m meshlm train --parallel.tp=2` as a user runs it (gloo on CPU), on the bundled corpus.

Checked: the tp=2 (+SP) run logs the same per-step losses and ends with the same weights as the
single-process run; only rank 0 logs and writes metrics; `meshlm generate` reads the checkpoint's
pieces as one model; it resumes exactly at the same layout, and under another one (here one process). The
launch forms of docs/parallel.md (two-node rendezvous included) run in test_docs_parallel.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
from meshlm.core.config import load_config
from meshlm.families.registry import get_spec
from meshlm.train.trainer import Trainer
from tests.conftest import ROOT, run_cli

GPT_SPEC = get_spec("gpt")  # every run here is of the gpt family (its pieces need the spec)

SMALL = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
         "--train.global_batch_size=4", "--train.eval_iters=1", "--train.eval_every=0", "--train.log_every=1",
         "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false", "--parallel.timeout_s=60"]
TIMEOUT_S = 150
TOL = 1e-5


def _torchrun(*args: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    launcher = launcher or ["--standalone", "--nproc_per_node=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "meshlm", "train", "--config",
           "gpt-tiny", *SMALL, *args]
    return subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def _losses(out) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def _weights(out) -> dict:
    return load_model_state(resolve_checkpoint(out), spec=GPT_SPEC)


def test_torchrun_tp2_sp_matches_single_process_and_generates(tmp_path):
    out = tmp_path / "tp2"
    proc = _torchrun("--parallel.tp=2", "--parallel.sp=true", "--train.max_steps=4", f"--train.out_dir={out}",
                     "--train.sample_tokens=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step      1 |") == 1, "only rank 0 logs"
    assert proc.stdout.count("---- sample ----") == 1, "rank 0 samples from the gathered model"
    assert "tp 2 with sequence parallelism" in proc.stdout
    ref = tmp_path / "tp1"
    Trainer(load_config("gpt-tiny", SMALL + ["--train.max_steps=4", f"--train.out_dir={ref}"])).run()
    got, want = _losses(out), _losses(ref)
    assert len(got) == 4, "one metrics line per step: rank 0 only"
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= TOL, (got, want)
    full, plain = _weights(out), _weights(ref)
    assert full.keys() == plain.keys() and full["tok_emb.weight"].shape == plain["tok_emb.weight"].shape
    assert max(float((full[k] - v).abs().max()) for k, v in plain.items()) <= TOL
    gen = run_cli("generate", "--checkpoint", str(out), "--prompt", "ROMEO.", "--max-new-tokens", "5", "--seed", "1")
    assert gen.returncode == 0 and gen.stdout.startswith("ROMEO."), gen.stderr


def test_torchrun_tp2_resumes_exactly_and_under_another_layout(tmp_path):
    dropout = "--model.dropout=0.1"  # the per-rank dropout stream must be restored too
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out, steps in ((straight, 4), (split, 2), (split, 4)):
        proc = _torchrun("--parallel.tp=2", dropout, f"--train.max_steps={steps}", f"--train.out_dir={out}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert sorted(p.name for p in resolve_checkpoint(split).iterdir()) == [
        "config.json", "index.json", "manifest.json", "shards", "state.pt"]
    assert _losses(straight) == _losses(split)
    a, b = _weights(straight), _weights(split)
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed = Trainer(load_config("gpt-tiny", SMALL + [dropout, "--train.max_steps=6", f"--train.out_dir={split}"]))
    assert resumed.step == 4, "one process resumes the tp=2 checkpoint (tests/parallel/test_data_parallel*.py)"

