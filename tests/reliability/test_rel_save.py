"""Saving: a re-save never leaves the step without a valid copy, a full disk gives one line and leaves
nothing behind, keep_last, metrics.jsonl after a kill, exit codes after SIGINT/SIGTERM (issue 13)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint import files
from meshlm.checkpoint.files import prune_old, prune_temporaries, verify
from meshlm.checkpoint.single import load_model_state, resolve_checkpoint, save_checkpoint
from meshlm.cli import main
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)

TINY = ["--config", "gpt-tiny", "--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32",
        "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.progress=false", "--train.peak_tflops=1",
        "--train.sample_tokens=0", "--train.log_every=1"]


def parts(value: float) -> dict:
    return {"model": {"w": torch.full((1000,), value)}, "state": {"step": 1}}


class Injected(BaseException):  # a crash: nothing handles it
    pass


@pytest.mark.parametrize("point", ["moving the new copy in", "renamed", "pointed"])
def test_a_resave_keeps_a_valid_checkpoint_of_the_step_at_every_moment(tmp_path, monkeypatch, point):
    save_checkpoint(tmp_path, 1, parts(1.0), {})
    if point == "moving the new copy in":  # the old copy is aside, the new one fails to move in
        real, calls = os.rename, []

        def rename(src, dst):
            calls.append(src)
            if len(calls) == 2:
                raise Injected(point)
            real(src, dst)
        monkeypatch.setattr(files.os, "rename", rename)
    elif point == "renamed":  # the new copy moved in, `latest` not yet rewritten
        real = os.rename

        def rename(src, dst):
            real(src, dst)
            if Path(src).name.startswith(".tmp-") and Path(dst).name == "step_0000001":
                raise Injected(point)
        monkeypatch.setattr(files.os, "rename", rename)
    else:  # `latest` rewritten and synced, the old copy not yet removed
        real_sync = files.fsync_dir

        def fsync_dir(path):
            real_sync(path)
            if Path(path) == tmp_path / "checkpoints":
                raise Injected(point)
        monkeypatch.setattr(files, "fsync_dir", fsync_dir)
    with pytest.raises(Injected):
        save_checkpoint(tmp_path, 1, parts(2.0), {})
    monkeypatch.undo()
    found = resolve_checkpoint(tmp_path, log=None)  # what a reader sees right after the crash
    assert float(load_model_state(found)["w"][0]) in (1.0, 2.0)
    prune_temporaries(tmp_path)  # what the next run does first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000001"]
    assert verify(tmp_path / "checkpoints" / "step_0000001") is None


def test_rerunning_a_finished_run_resaves_its_step_in_place(tmp_path):
    Trainer(tiny_config(tmp_path, train={"max_steps": 2})).run()
    before = load_model_state(resolve_checkpoint(tmp_path))
    Trainer(tiny_config(tmp_path, train={"max_steps": 2})).run()
    after = load_model_state(resolve_checkpoint(tmp_path, log=None))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000002"]


def full_disk_at(monkeypatch, step_dir_part: str) -> None:
    """Every write into a temporary directory of `step_dir_part` fails with ENOSPC after 4 KiB."""
    real = files._ChecksumWriter._disk_write

    def write(self, view):
        if step_dir_part in self.fh.name and self.size > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, view)
    monkeypatch.setattr(files._ChecksumWriter, "_disk_write", write)


def assert_one_clear_line(err: str, step: int) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: could not write step {step}'s checkpoint (no space left on device) at "), err
    assert "model.pt: it needs about " in err and " MiB" in err and "train.out_dir" in err, err


ASYNC = [pytest.param([], id="sync"), pytest.param(["--train.async_save=true"], id="async")]  # background writes


@pytest.mark.parametrize("mode", ASYNC)
def test_disk_full_gives_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch, capsys, mode):
    full_disk_at(monkeypatch, ".tmp-step_0000002-")
    rc = main(["train", *TINY, f"--train.out_dir={tmp_path}", "--train.max_steps=3", "--train.save_every=1", *mode])
    assert rc == 2
    assert_one_clear_line(capsys.readouterr().err, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000001"]
    assert resolve_checkpoint(tmp_path).name == "step_0000001"


def test_a_real_full_tmpfs_gives_one_line_and_leaves_nothing_behind(tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                           check=False)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        rc = main(["train", *TINY, f"--train.out_dir={disk}", "--train.max_steps=1"])
        assert rc == 2
        assert_one_clear_line(capsys.readouterr().err, 1)
        assert not any((disk / "checkpoints").iterdir()), "the partial checkpoint is removed"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_keep_last_keeps_the_newest_valid_checkpoints(tmp_path):
    Trainer(tiny_config(tmp_path / "a", train={"max_steps": 4, "save_every": 1, "keep_last": 2})).run()
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step_*")) == ["step_0000003", "step_0000004"]
    Trainer(tiny_config(tmp_path / "b", train={"max_steps": 3, "save_every": 1, "keep_last": 0})).run()
    assert len(list((tmp_path / "b" / "checkpoints").glob("step_*"))) == 3
    (tmp_path / "b" / "checkpoints" / "step_0000003" / "optim.pt").write_bytes(b"")  # the newest is broken
    prune_old(tmp_path / "b", keep_last=1, newest=3)
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*")) == ["step_0000002", "step_0000003"]


def train_steps(out) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(ln)["kind"] == "train"]


def test_metrics_survive_a_torn_line_and_restart_with_the_checkpoint(tmp_path, capsys):
    Trainer(tiny_config(tmp_path, train={"max_steps": 2})).run()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "train", "step": 3, "lo')  # killed while writing step 3's line
    Trainer(tiny_config(tmp_path, train={"max_steps": 3})).run()
    assert train_steps(tmp_path) == [1, 2, 3]
    assert "skipped 1 unreadable line(s)" in capsys.readouterr().out


def test_a_fresh_start_truncates_metrics_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n{"kind": "train", "step": 2}\n')
    Trainer(tiny_config(tmp_path, train={"max_steps": 2})).run()
    assert train_steps(tmp_path) == [1, 2]


@pytest.mark.parametrize("mode", [[], ["--train.async_save=true", "--train.save_every=1"]], ids=["sync", "async"])
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_and_exits_128_plus_its_number(tmp_path, monkeypatch, sig, code, capsys, mode):
    real = Trainer.train_step

    def step(self):
        out = real(self)
        if self.step == 2:
            os.kill(os.getpid(), sig)
        return out
    monkeypatch.setattr(Trainer, "train_step", step)
    assert main(["train", *TINY, f"--train.out_dir={tmp_path}", "--train.max_steps=50", *mode]) == code
    assert f"stopped by {sig.name} at step 2" in capsys.readouterr().out
    assert resolve_checkpoint(tmp_path).name == "step_0000002"
