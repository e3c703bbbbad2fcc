"""`meshlm train --config bert-tiny` as a user runs it (narrow model, a few steps), on the bundled corpus:
the logged parts (MLM and sentence-order loss and accuracy), the held-out evaluation (MLM accuracy and
perplexity), an exact resume, and a pipeline-parallel torchrun run equal to one process. The runs that only
compare numbers go through `meshlm.cli.main` in this process (no interpreter start each)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from meshlm.cli import main
from tests.conftest import ROOT, run_cli

SMALL = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
         "--train.global_batch_size=4", "--train.eval_iters=2", "--train.peak_tflops=1", "--train.log_every=1",
         "--train.progress=false"]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(*args: str) -> str:
    """`meshlm train --config bert-tiny ARGS` in this process; its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", "--config", "bert-tiny", *args]) == 0
    return out.getvalue()


def test_bert_tiny_trains_logs_parts_and_evaluates(tmp_path):
    out = tmp_path / "bert"
    proc = run_cli("train", "--config", "bert-tiny", *SMALL, "--train.max_steps=4", "--train.eval_every=2",
                   f"--train.out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    recs = _records(out)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    for r in train:
        assert {"mlm_loss", "sop_loss", "mlm_acc", "sop_acc"} <= set(r)
        assert r["loss"] == pytest.approx(r["mlm_loss"] + r["sop_loss"], rel=1e-5)  # one micro-batch mean each
        assert 0 <= r["mlm_acc"] <= 1 and 0 <= r["sop_acc"] <= 1
        assert r["mlm_loss"] > 5  # a fresh model over a 30,522-word vocabulary: near ln(30522) = 10.3
    for r in evals:
        assert {"val_loss", "val_mlm_loss", "val_mlm_acc", "val_mlm_ppl", "val_sop_acc"} <= set(r)
        assert r["val_mlm_ppl"] == pytest.approx(2.718281828 ** r["val_mlm_loss"], rel=1e-6)
    assert "mlm_acc" in proc.stdout and "val_mlm_acc" in proc.stdout


def test_bert_resume_is_exact(tmp_path):
    """Stopped after 2 steps and resumed to 4 (dropout on: the random streams come back too) equals 4 in a row."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(*SMALL, "--train.max_steps=4", f"--train.out_dir={straight}")
    _train(*SMALL, "--train.max_steps=2", f"--train.out_dir={split}")
    assert "resumed from" in _train(*SMALL, "--train.max_steps=4", f"--train.out_dir={split}")
    want = [(r["step"], r["loss"], r["sop_acc"]) for r in _records(straight) if r["kind"] == "train"]
    got = [(r["step"], r["loss"], r["sop_acc"]) for r in _records(split) if r["kind"] == "train"]
    assert got == want


def test_bert_pipeline_torchrun_equals_one_process(tmp_path):
    """pp=2 under torchrun: the parts are computed on the last stage and reach rank 0's log."""
    common = [*SMALL, "--model.dropout=0", "--train.max_steps=3", "--train.eval_every=3", "--train.micro_batch_size=1"]
    one = tmp_path / "one"
    _train(*common, f"--train.out_dir={one}")
    pp = tmp_path / "pp"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "meshlm", "train", "--config", "bert-tiny", *common, "--parallel.pp=2",
                           "--parallel.timeout_s=60", f"--train.out_dir={pp}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _records(one), _records(pp)
    assert [r["kind"] for r in a] == [r["kind"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("loss", "mlm_loss", "sop_loss", "mlm_acc", "sop_acc", "val_loss", "val_mlm_acc", "val_sop_acc"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-6), (key, ra, rb)


def test_bert_mixed_precision_follows_fp32(tmp_path):
    """bf16 autocast and fp16 with dynamic loss scaling train BERT as fp32 does, to their rounding."""
    losses = {}
    for precision in ("fp32", "bf16", "fp16"):
        out = tmp_path / precision
        _train(*SMALL, "--train.max_steps=3", f"--train.precision={precision}", f"--train.out_dir={out}")
        losses[precision] = [r["loss"] for r in _records(out) if r["kind"] == "train"]
    for precision in ("bf16", "fp16"):
        assert losses[precision] == pytest.approx(losses["fp32"], rel=2e-2), (precision, losses)
        assert losses[precision] != losses["fp32"]  # the low precision was in use


def test_bench_memory_command_of_docs_bert(tmp_path):
    """docs/bert.md's `meshlm bench memory` line, as typed: BERT's layers save what the formula says."""
    doc = (ROOT / "docs" / "bert.md").read_text()
    line = next(ln.strip() for ln in doc.splitlines() if ln.strip().startswith(".venv/bin/meshlm bench memory"))
    args = line.split()[1:]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    total = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| all |"))
    assert total.rstrip(" |").endswith("1.000"), total
