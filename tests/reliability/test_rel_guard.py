"""Non-finite steps: skipped, counted, never saved; max_bad_steps stops with exit 2; one host sync per step."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from meshlm.checkpoint.single import load_model_state, load_part, save_checkpoint
from meshlm.cli import main
from meshlm.core.errors import TrainingError
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)

TINY = ["--config", "gpt-tiny", "--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32",
        "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.progress=false", "--train.peak_tflops=1",
        "--train.sample_tokens=0", "--train.log_every=1"]


@pytest.fixture
def nan_at(monkeypatch):
    """Make the loss (and so every gradient) NaN at the given steps (1-based), deterministically."""
    bad: set[int] = set()
    real = Trainer.loss

    def loss(self, x, y):
        out = real(self, x, y)
        return out * float("nan") if self.step + 1 in bad else out

    monkeypatch.setattr(Trainer, "loss", loss)
    return bad


def test_a_nan_step_is_skipped_counted_and_never_saved(tmp_path, nan_at, capsys):
    nan_at.add(2)
    Trainer(tiny_config(tmp_path, train={"max_steps": 3, "save_every": 1, "keep_last": 0})).run()
    assert "warning: step 2: loss nan, gradient norm nan not finite; update skipped" in capsys.readouterr().out
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in recs if r["kind"] == "train"] == [0, 1, 1]
    states = {s: load_model_state(tmp_path / "checkpoints" / f"step_000000{s}") for s in (1, 2, 3)}
    for state in states.values():
        assert all(torch.isfinite(v).all() for v in state.values())
    assert all(torch.equal(states[1][k], states[2][k]) for k in states[1]), "no update at the skipped step"
    assert not all(torch.equal(states[2][k], states[3][k]) for k in states[1]), "training goes on after it"
    optim1, optim2 = (load_part(tmp_path / "checkpoints" / f"step_000000{s}", "optim") for s in (1, 2))
    assert all(torch.equal(optim1["state"][i]["exp_avg"], optim2["state"][i]["exp_avg"]) for i in optim1["state"])
    assert load_part(tmp_path / "checkpoints" / "step_0000003", "state")["skipped_steps"] == 1


def test_max_bad_steps_in_a_row_stop_with_exit_2_and_no_checkpoint_after_them(tmp_path, nan_at, capsys):
    nan_at.update({2, 3, 4})
    rc = main(["train", *TINY, f"--train.out_dir={tmp_path}", "--train.max_steps=6", "--train.save_every=1",
               "--train.max_bad_steps=3"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: stopped at step 4: 3 steps in a row") and \
        "train.max_bad_steps=3" in err and "optim.lr" in err, err
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert steps[-1] == "step_0000003", steps  # 2 and 3 were saved unchanged (finite); nothing after step 4


def test_a_huge_learning_rate_stops_cleanly_without_a_nan_checkpoint(tmp_path, capsys):
    rc = main(["train", *TINY, f"--train.out_dir={tmp_path}", "--train.max_steps=30", "--train.save_every=1",
               "--optim.lr=1e4", "--optim.warmup_steps=1", "--train.keep_last=0"])
    err = capsys.readouterr().err
    assert rc == 2 and "train.max_bad_steps=5" in err and "Traceback" not in err, err
    for step in (tmp_path / "checkpoints").glob("step_*"):
        assert all(torch.isfinite(v).all() for v in load_model_state(step).values()), step


def test_weights_with_nan_are_never_published(tmp_path):
    with pytest.raises(TrainingError, match="refusing to save step 1: the model's weights hold NaN or inf"):
        save_checkpoint(tmp_path, 1, {"model": {"w": torch.tensor([1.0, float("nan")])}}, {})
    assert not any((tmp_path / "checkpoints").glob("*")), "nothing published, nothing left behind"


def test_one_host_sync_per_step(tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tmp_path, train={"max_steps": 4}))
    assert not getattr(trainer.model, "loss_on_target_rows", False)  # pretraining: no count of target rows
    trainer.train_step()  # the first step also logs the memory report
    calls = []

    def counting(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if "/meshlm/" in caller:  # conversions meshlm asks for (torch's own CPU bookkeeping aside)
                calls.append((name, caller, sys._getframe(1).f_lineno))
            return real(self, *a, **k)
        return wrapper

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    for _ in range(2):
        trainer.train_step()
    assert len(calls) == 2, calls  # one `tolist` of (loss, grad norm) per step
