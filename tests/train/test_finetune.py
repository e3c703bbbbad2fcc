"""`meshlm finetune` end to end on a tiny BERT (real WordPiece tokenizer, small learnable tasks in real words):
a classifier beats the majority class and logs accuracy and F1 per evaluation; the span and tokens heads
lower their losses and report their metrics; a stopped run resumed by the same command continues exactly;
bad input is one line `error: ...`, exit 2, and no run directory."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter

import pytest

from meshlm.cli import main
from tests.conftest import ROOT, run_cli
from tests.train.finetune_helpers import (
    QUIET,
    classify_rows,
    eval_rows,
    save_base,
    span_rows,
    tokens_rows,
    train_losses,
    write_jsonl,
)


def finetune_argv(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `meshlm ARGV` in this process."""
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = main(argv)
    return code, o.getvalue(), e.getvalue()


def finetune(base, task, train, valid, out, *extra) -> tuple[int, str, str]:
    return finetune_argv(["finetune", "--checkpoint", str(base), "--task", task, "--train", str(train), "--valid",
                          str(valid), "--out", str(out), *QUIET, *extra])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_base(tmp_path_factory.mktemp("base") / "run")


def test_classify_beats_the_majority_class(base, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", classify_rows(240, seed=1))
    valid_rows = classify_rows(45, seed=2)
    valid = write_jsonl(tmp_path / "valid.jsonl", valid_rows)
    out = tmp_path / "run"
    code, stdout, stderr = finetune(base, "classify", train, valid, out, "--optim.lr=2e-3", "--epochs=4",
                                    "--train.global_batch_size=16")
    assert code == 0, stderr
    rows = eval_rows(out)
    assert [r["step"] for r in rows] == [15, 30, 45, 60]  # one evaluation per epoch of 240 / 16 steps
    majority = max(Counter(r["label"] for r in valid_rows).values()) / len(valid_rows)
    last = rows[-1]
    # From a random base this tiny model sometimes stalls a while with two classes merged (0.6-0.7 here);
    # over seeds it ended at least 0.2 above the majority class after 6 epochs, this seed at 1.0 after 3.
    assert last["val_accuracy"] > majority + 0.15, (majority, rows)
    assert last["val_f1"] > 0.4 and last["val_loss"] < rows[0]["val_loss"]
    assert "eval step 60: val_loss" in stdout and "| val_accuracy " in stdout and "| val_f1 " in stdout
    info = json.loads((out / "finetune.json").read_text())
    assert info["names"] == ["animal", "colour", "number"] and info["num_labels"] == 3
    assert "classes animal" in stdout


def test_span_head_learns_and_reports_exact_match(base, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", span_rows(112, seed=3))
    valid = write_jsonl(tmp_path / "valid.jsonl", span_rows(37, seed=4))
    out = tmp_path / "run"
    code, _, stderr = finetune(base, "span", train, valid, out, "--optim.lr=1e-2", "--epochs=3",
                               "--train.global_batch_size=16")
    assert code == 0, stderr
    losses, rows = train_losses(out), eval_rows(out)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert set(rows[-1]) >= {"val_loss", "val_exact_match", "val_f1"}
    assert rows[-1]["val_exact_match"] > 0.5 and rows[-1]["val_f1"] >= rows[-1]["val_exact_match"]


def test_tokens_head_learns_and_reports_accuracy(base, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", tokens_rows(112, seed=5))
    valid = write_jsonl(tmp_path / "valid.jsonl", tokens_rows(37, seed=6))
    out = tmp_path / "run"
    code, _, stderr = finetune(base, "tokens", train, valid, out, "--optim.lr=1e-2", "--epochs=3",
                               "--train.global_batch_size=16")
    assert code == 0, stderr
    losses, rows = train_losses(out), eval_rows(out)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert rows[-1]["val_accuracy"] > 0.8 and rows[-1]["val_f1"] > 0.6, rows


def test_a_stopped_run_resumes_exactly(base, tmp_path):
    """6 steps straight vs 3 steps then the same command with 6: the same losses (dropout on: its random
    streams come back from the checkpoint too). The schedule is pinned (decay_steps) so that both runs'
    first steps see the same learning rates."""
    train = write_jsonl(tmp_path / "train.jsonl", classify_rows(64, seed=7))
    valid = write_jsonl(tmp_path / "valid.jsonl", classify_rows(10, seed=8))
    pinned = ["--optim.decay_steps=6", "--optim.warmup_steps=2", "--train.global_batch_size=16",
              "--train.log_every=1"]
    code, _, err = finetune(base, "classify", train, valid, tmp_path / "straight", *pinned, "--train.max_steps=6")
    assert code == 0, err
    code, _, err = finetune(base, "classify", train, valid, tmp_path / "stopped", *pinned, "--train.max_steps=3")
    assert code == 0, err
    code, stdout, err = finetune(base, "classify", train, valid, tmp_path / "stopped", *pinned,
                                 "--train.max_steps=6")
    assert code == 0, err
    assert "resumed from" in stdout and "step_0000003" in stdout
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "stopped")
    assert len(straight) == len(resumed) == 6
    assert resumed == straight
    assert eval_rows(tmp_path / "stopped")[-1]["val_loss"] == eval_rows(tmp_path / "straight")[-1]["val_loss"]


# ---- bad input ------------------------------------------------------------------------------------------------
BAD = {
    "no label": ([{"text": "a b", "label": 0}, {"text": "c d"}], None, [],
                 r"train.jsonl:2: no 'label' field"),
    "label beyond the given classes": ([{"text": "a", "label": 0}, {"text": "b", "label": 3}], None,
                                       ["--model.num_labels=3"],
                                       r"train.jsonl:2: label 3 is outside the head's range 0..2 set by model.num_labels=3"),
    "valid label beyond training's": (None, [{"text": "a", "label": 0}, {"text": "b", "label": 2}], [],
                                      r"valid.jsonl:2: label 2 is outside the head's range 0..1"),
    "too long": ([{"text": "a", "label": 0}, {"text": "word " * 40, "label": 1}], None, [],
                 r"train.jsonl:2: the example is 42 tokens .*longer than the model's model.seq_len=16.*--truncate"),
    "not json": (["{\"text\": \"a\", \"label\": 0}", "{oops"], None, [], r"train.jsonl:2: not valid JSON"),
    "empty file": ([], None, [], r"--train '.*train.jsonl' holds no examples"),
}
GOOD_TRAIN = [{"text": "a b", "label": 0}, {"text": "c d", "label": 1}]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_is_one_line_and_leaves_no_run(base, tmp_path, case):
    train_rows, valid_rows, extra, message = BAD[case]
    for name, rows in (("train", train_rows), ("valid", valid_rows)):
        rows = GOOD_TRAIN if rows is None else rows
        (tmp_path / f"{name}.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                                                        for r in rows))
    out = tmp_path / "run"
    code, _, stderr = finetune(base, "classify", tmp_path / "train.jsonl", tmp_path / "valid.jsonl", out, *extra)
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    assert re.search(message, stderr), stderr
    assert not out.exists()


def test_a_gpt_checkpoint_a_missing_file_and_a_missing_base_are_refused(tmp_path):
    gpt = save_base(tmp_path / "gpt", family="gpt")
    data = write_jsonl(tmp_path / "d.jsonl", GOOD_TRAIN)
    out = tmp_path / "run"
    cases = [(gpt, data, "holds a model.family='gpt' model; meshlm finetune needs a BERT checkpoint"),
             (gpt, tmp_path / "missing.jsonl", "--train '.*missing.jsonl' does not exist"),
             (tmp_path / "nothing", data, "no checkpoint at")]
    for checkpoint, train, message in cases:
        code, _, stderr = finetune(checkpoint, "classify", train, data, out)
        assert code == 2 and stderr.count("\n") == 1 and re.search(message, stderr), stderr
        assert not out.exists()


def test_the_installed_command_refuses_in_one_line(base, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": 0}, {"txt": "b", "label": 1}])
    proc = run_cli("finetune", "--checkpoint", str(base), "--task", "classify", "--train", str(train), "--valid",
                   str(train), "--out", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"error: {train}:2: no 'text' field; every line of a classify file needs one\n"
    assert not (tmp_path / "run").exists()


def test_the_documented_genre_commands_run(tmp_path):
    """docs/finetune.md's `$ ` commands in a fresh directory, with a tiny BERT of 64 positions standing in
    for runs/bert-tiny and 2 steps; the printed data and plan lines are the documented ones."""
    doc = (ROOT / "docs" / "finetune.md").read_text()
    commands = [shlex.split(line[2:]) for line in doc.splitlines() if line.startswith("$ ")]
    assert [c[:2] for c in commands] == [["python", "scripts/make_genre_task.py"], ["meshlm", "finetune"]]
    save_base(tmp_path / "runs" / "bert-tiny", seq_len=64)
    script = commands[0][1]
    gen = subprocess.run([sys.executable, str(ROOT / script), *commands[0][2:]], cwd=tmp_path, capture_output=True,
                         text=True, check=False, timeout=120)
    assert gen.returncode == 0, gen.stderr
    code, stdout, stderr = 0, "", ""
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        code, stdout, stderr = finetune_argv([*commands[1][1:], *QUIET, "--train.max_steps=2"])
    finally:
        os.chdir(cwd)
    assert code == 0, stderr
    shown = [line for line in doc.splitlines() if line.startswith(("--train ", "--valid ", "fine-tuning "))]
    printed = stdout.splitlines()
    assert shown[:2] == printed[:2]
    assert shown[2].replace("57 steps", "2 steps") == printed[2]
    assert eval_rows(tmp_path / "runs" / "genre")[-1]["step"] == 2
