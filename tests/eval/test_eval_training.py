"""`train.eval_tasks`: the tasks run at each evaluation, logged to metrics.jsonl and TensorBoard as
val_<task>_<metric>, equal to `meshlm eval` on the checkpoint the run ends with (one process, and under
pp=2 with the fused head on the last stage); bad entries are one error line."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from meshlm.cli import main

TINY = ["--config", "gpt-tiny", "--model.n_layers=2", "--model.hidden_size=64", "--model.seq_len=32",
        "--train.max_steps=2", "--train.eval_every=1", "--train.eval_iters=1", "--train.micro_batch_size=2",
        "--train.global_batch_size=2", "--train.sample_tokens=0", "--train.progress=false",
        "--train.peak_tflops=1", "--train.log_every=1"]


def eval_rows(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "eval"]


def meshlm_eval(checkpoint, kind, path) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["eval", "--checkpoint", str(checkpoint), "--task", kind, "--data", str(path)]) == 0
    return json.loads(buf.getvalue())


def check_against_eval(out, task_files):
    rows = eval_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    cloze = meshlm_eval(out, "cloze", task_files["cloze"])
    choice = meshlm_eval(out, "choice", task_files["choice"])
    for key in ("accuracy", "accuracy_last_token", "perplexity"):
        assert last[f"val_cloze_{key}"] == pytest.approx(cloze[key], rel=1e-5), key
    for key in ("accuracy", "accuracy_norm"):
        assert last[f"val_choice_{key}"] == pytest.approx(choice[key], rel=1e-5), key
    assert rows[0]["val_cloze_perplexity"] != rows[1]["val_cloze_perplexity"]  # measured at each evaluation


def test_eval_tasks_are_logged_and_equal_meshlm_eval(task_files, tmp_path):
    out = tmp_path / "run"
    tasks = f"--train.eval_tasks=['cloze:{task_files['cloze']}', 'choice:{task_files['choice']}']"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", *TINY, f"--train.out_dir={out}", tasks]) == 0
    check_against_eval(out, task_files)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"valid/val_cloze_accuracy", "valid/val_choice_accuracy_norm"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("valid/val_cloze_perplexity")) == 2


def test_eval_tasks_under_pipeline_parallelism(task_files, tmp_path):
    out = tmp_path / "pp2"
    tasks = f"--train.eval_tasks=['cloze:{task_files['cloze']}', 'choice:{task_files['choice']}']"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "meshlm", "train", *TINY, f"--train.out_dir={out}", tasks, "--parallel.pp=2",
                           "--parallel.timeout_s=60"], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_against_eval(out, task_files)


@pytest.mark.parametrize("value,message", [
    ("['hellaswag']", "train.eval_tasks entry 'hellaswag' is neither a shipped set"),
    ("['cloze:']", "train.eval_tasks entry 'cloze:' is neither"),
    ("['cloze:/nonexistent.jsonl']", "'/nonexistent.jsonl' does not exist"),
])
def test_bad_eval_tasks_are_one_error_line(tmp_path, value, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", *TINY, f"--train.out_dir={tmp_path / 'r'}", f"--train.eval_tasks={value}"])
    assert code == 2 and err.getvalue().startswith("error: ") and message in err.getvalue(), err.getvalue()
    assert err.getvalue().count("\n") == 1
