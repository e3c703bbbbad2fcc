"""Commands, third round (issue 35, items 10 and 13): a CUDA device on a CPU-only torch, an out_dir that
cannot be created, a template with an unmatched brace, a split without validation data and an empty
`--json-key` each get one line (exit 2, or a warning where the run can go on), never a traceback."""

from __future__ import annotations

import json

import pytest
import torch

from meshlm.cli import main
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)
from tests.tune.tune_helpers import save_base

TINY = ["--config", "gpt-tiny", "--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32",
        "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.progress=false", "--train.max_steps=1",
        "--train.peak_tflops=1", "--train.sample_tokens=0"]


def one_error_line(capsys, *names: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert all(name in err for name in names), err
    return err


# ---- 10: tracebacks ---------------------------------------------------------------------------------------
def test_cuda_on_a_torch_without_cuda_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch, on any host
    assert main(["train", *TINY, f"--train.out_dir={tmp_path / 'run'}", "--train.device=cuda"]) == 2
    one_error_line(capsys, "train.device", "cpu")
    assert main(["bench", "memory", *TINY[:6], "--train.device=cuda"]) == 2
    one_error_line(capsys, "train.device")


def test_an_out_dir_that_cannot_be_created_is_one_line(capsys):
    out = "/proc/meshlm-no-such-dir/run"  # /proc takes no new directories, even from root
    assert main(["train", *TINY, f"--train.out_dir={out}"]) == 2
    one_error_line(capsys, "train.out_dir", "cannot be created")


@pytest.mark.parametrize("template", ["{q {answer}", "Q: {q}} {answer}", "{answer"])
def test_a_template_with_an_unmatched_brace_is_one_line(tmp_path, capsys, template):
    base = save_base(tmp_path / "base")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"q": "sky", "answer": "blue"}) + "\n")
    out = tmp_path / "tuned"
    assert main(["tune", "--checkpoint", str(base), "--method", "prompt", "--train", str(data), "--valid", str(data),
                 "--out", str(out), "--template", template]) == 2
    one_error_line(capsys, "--template", "cannot be read", "{{")
    assert not out.exists()


# ---- 13: no validation data, an empty --json-key --------------------------------------------------------
def test_a_split_without_validation_warns_and_refuses_periodic_evaluation(tmp_path, capsys):
    args = ["train", *TINY, f"--train.out_dir={tmp_path / 'run'}", "--data.split=100,0,0"]
    assert main([*args, "--train.eval_every=1"]) == 2
    one_error_line(capsys, "data.split='100,0,0'", "train.eval_every=1")
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert main([*args, "--train.eval_every=0"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "data.split='100,0,0'" in warnings[0] and "no validation" in warnings[0], err


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_json_key_is_refused_before_reading(tmp_path, capsys, key):
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    assert main(["prepare", "--input", str(data), "--output", str(tmp_path / "out"), "--json-key", key]) == 2
    one_error_line(capsys, "--json-key")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"], "nothing read, nothing written"
    missing = str(tmp_path / "missing.jsonl")  # refused before the inputs are even looked at
    assert main(["prepare", "--input", missing, "--output", str(tmp_path / "out"), "--json-key", key]) == 2
    one_error_line(capsys, "--json-key")
    assert main(["tokenizer", "train", "--input", missing, "--vocab-size", "300", "--output",
                 str(tmp_path / "tok"), "--json-key", key]) == 2
    one_error_line(capsys, "--json-key")
