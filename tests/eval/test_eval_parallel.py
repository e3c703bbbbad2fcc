"""`torchrun … meshlm eval` under tensor parallelism (tp=2: vocabulary-split logits, the padded vocabulary
of 50,257 tokens) and pipeline parallelism (pp=2: the stages' forwards by hand) gives the numbers of one
process: the accuracies exactly, the perplexities within 1e-5 (relative)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from meshlm.cli import main

# Perplexity (rolling windows) and choice (continuations) are the two kinds of request every task makes; the
# README's test runs a cloze set under tp=2 too, and tests/eval/test_eval_training.py the trainer under pp=2.
CASES = {"tp2_perplexity": (["--parallel.tp=2"], "perplexity", ["--stride", "5"]),
         "pp2_choice": (["--parallel.pp=2"], "choice", ["--batch-size", "3"])}


def one_process(checkpoint, kind, path, extra) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", "--checkpoint", str(checkpoint), "--task", kind, "--data", str(path), *extra]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_one_process(tiny_gpt, task_files, case):
    layout, kind, extra = CASES[case]
    ref = one_process(tiny_gpt, kind, task_files[kind], extra)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "meshlm", "eval", "--checkpoint", str(tiny_gpt), "--task", kind, "--data",
                           str(task_files[kind]), *extra, *layout, "--parallel.timeout_s=60"],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    got = json.loads(lines[0])
    assert got["layout"]["world_size"] == 2
    metrics = [k for k in ref if k.startswith(("accuracy", "perplexity", "word_perplexity", "bits_per_byte"))]
    assert len(metrics) >= 2
    if kind != "perplexity":
        assert 0 < ref["accuracy"] < 1  # the comparison is not of a constant
    for key in metrics:
        if key.startswith("accuracy"):
            assert got[key] == ref[key], key
        else:
            assert got[key] == pytest.approx(ref[key], rel=1e-5), key
