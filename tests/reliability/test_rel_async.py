"""train.async_save: checkpoints copied at the step and written by a background thread hold exactly what a
synchronous save writes, resume exactly, are written one at a time, stop the run on a write error with the
synchronous message, survive kill -9 and a signal mid-write, and a 2-process (gloo) run's equal its
synchronous twin's. Disk full and SIGINT/SIGTERM with async_save also run in test_rel_save.py, random
kill -9 moments in test_rel_kill.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from meshlm.checkpoint import files
from meshlm.checkpoint.files import read_manifest, step_name, usable
from meshlm.checkpoint.single import latest_checkpoint, load_model_state, load_part, resolve_checkpoint
from meshlm.cli import main
from meshlm.families.registry import get_spec
from meshlm.train.extension import Extension
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.parallel.parallel_world import run_world
from tests.reliability import forked
from tests.reliability.test_rel_kill import records
from tests.reliability.test_rel_save import TINY
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)

GPT_SPEC = get_spec("gpt")  # every run here is of the gpt family (its pieces need the spec)

def config(out, steps: int = 4, parallel: dict | None = None, **train):
    return tiny_config(out, train={"max_steps": steps, "save_every": 1, "keep_last": 0, "sample_tokens": 0,
                                   "global_batch_size": 4, **train}, model={"dropout": 0.1}, parallel=parallel or {})


def same(a, b) -> bool:
    """Equal nested checkpoint contents: tensors (dtype, shape, values), arrays, dicts, lists, plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def entries(step_dir: Path) -> dict:
    """The manifest's size and CRC-32 of every file but config.json (which names the run's out_dir)."""
    files = read_manifest(step_dir)["files"]
    return {k: v for k, v in files.items() if k != "config.json"}


class Published(Extension):
    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    def published(self, trainer, path: Path) -> None:
        self.seen.append((path.name, threading.current_thread().name))


def test_an_async_checkpoint_holds_exactly_what_a_sync_one_holds(tmp_path):
    hooks = {}
    for mode in ("sync", "async"):
        hooks[mode] = Published()
        Trainer(config(tmp_path / mode, steps=3, async_save=mode == "async"), extensions=[hooks[mode]]).run()
    for step in (1, 2, 3):
        a, b = (tmp_path / mode / "checkpoints" / step_name(step) for mode in ("sync", "async"))
        assert usable(b, resume=True) is None
        assert entries(a) == entries(b), f"step {step}: the same bytes in every file"
        for part in ("model", "optim", "state"):
            assert same(load_part(a, part), load_part(b, part)), (step, part)
    names = [(step_name(s), "MainThread") for s in (1, 2, 3)]
    assert hooks["sync"].seen == names and hooks["async"].seen == names, hooks["async"].seen


def test_resuming_from_an_async_checkpoint_is_exact(tmp_path):
    Trainer(config(tmp_path / "ref")).run()
    out = tmp_path / "async"
    Trainer(config(out, async_save=True)).run()
    for step in (3, 4):  # as if killed after step 2's background checkpoint was published
        shutil.rmtree(out / "checkpoints" / step_name(step))
    Trainer(config(out, async_save=True)).run()
    assert records(out) == records(tmp_path / "ref")
    a, b = (load_model_state(resolve_checkpoint(p), spec=GPT_SPEC) for p in (tmp_path / "ref", out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def slow_write(monkeypatch, step: int, until: threading.Event) -> None:
    """Writes into step `step`'s temporary directory block until `until` is set (at most 60 s)."""
    real = files._ChecksumWriter._disk_write

    def write(self, view):
        if f".tmp-{step_name(step)}-" in self.fh.name:
            assert until.wait(60), "the gate was never opened"
        return real(self, view)
    monkeypatch.setattr(files._ChecksumWriter, "_disk_write", write)


def test_the_next_save_waits_for_the_write_in_flight_and_says_so(tmp_path, monkeypatch, capsys):
    gate = threading.Event()
    slow_write(monkeypatch, 1, gate)  # step 1's write lasts until step 2's save has begun
    real = Trainer.save

    def save(self, *args, **kwargs):
        if self.step == 2:
            gate.set()
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Trainer, "save", save)
    Trainer(config(tmp_path, steps=3, async_save=True)).run()
    out = capsys.readouterr().out
    assert out.count(" s at step 2 for step 1's background write to finish") == 1, out
    assert "checkpoint: waited " in out.split("step      2 |")[1].split("step      3 |")[0], "at step 2's save"
    for step in (1, 2, 3):
        assert usable(tmp_path / "checkpoints" / step_name(step), resume=True) is None


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_a_background_write_waits_for_it_and_publishes_it(tmp_path, monkeypatch, capsys, sig, code):
    gate = threading.Event()
    slow_write(monkeypatch, 2, gate)  # step 2's write lasts until the final save has begun
    real_save, real_step = Trainer.save, Trainer.train_step

    def save(self, *args, **kwargs):
        if self.stop_signal is not None:
            gate.set()
        return real_save(self, *args, **kwargs)

    def step(self):
        out = real_step(self)
        if self.step == 3:
            os.kill(os.getpid(), sig)
        return out
    monkeypatch.setattr(Trainer, "save", save)
    monkeypatch.setattr(Trainer, "train_step", step)
    args = ["--train.save_every=2", "--train.async_save=true", "--train.max_steps=50"]
    assert main(["train", *TINY, f"--train.out_dir={tmp_path}", *args]) == code
    out = capsys.readouterr().out
    assert "waited" in out and "at step 3 for step 2's background write" in out, out
    assert f"stopped by {sig.name} at step 3" in out
    for step in (2, 3):
        assert usable(tmp_path / "checkpoints" / step_name(step), resume=True) is None
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def _train_steps_logged(out: Path) -> list[int]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            steps.append(rec["step"])
    return steps


def test_kill9_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_exactly(tmp_path):
    Trainer(config(tmp_path / "ref", steps=6)).run()
    out = tmp_path / "killed"
    # step 3's background write never ends; training goes on until step 4's save waits for it
    run = forked.Run(config(out, steps=6, async_save=True), tmp_path / "stacks", stall_write=".tmp-step_0000003-")
    marker = run.stalled
    try:
        start = time.monotonic()
        while not (marker.exists() and 4 in _train_steps_logged(out)):
            assert run.alive(), "the run ended before it was killed"
            assert time.monotonic() - start < 120, f"no stalled write of step 3 and step 4 in 120 s:\n{run.stack()}"
            time.sleep(0.01)
    finally:
        run.kill()
    assert marker.exists() and 4 in _train_steps_logged(out), "step 4 ran while step 3 was being written"
    assert list((out / "checkpoints").glob(".tmp-step_0000003-*")), "killed in the middle of step 3's write"
    assert latest_checkpoint(out).name == "step_0000002"
    Trainer(config(out, steps=6, async_save=True)).run()
    assert records(out) == records(tmp_path / "ref")
    a, b = (load_model_state(resolve_checkpoint(p), spec=GPT_SPEC) for p in (tmp_path / "ref", out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_a_corrupt_async_checkpoint_falls_back_to_the_previous_one(tmp_path):
    Trainer(config(tmp_path, steps=3, async_save=True)).run()  # steps 1 and 2 written in the background
    root = tmp_path / "checkpoints"
    shutil.rmtree(root / "step_0000003")
    model = root / "step_0000002" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    notes = []
    assert resolve_checkpoint(tmp_path, log=notes.append).name == "step_0000001"
    assert "step_0000002 is incomplete (model.pt: checksum mismatch" in notes[0], notes


def _sync_and_async(rank: int, world: int, out_dir: str) -> None:
    """One gloo world (dp = 2) trains the same run twice: synchronous saves, then background ones."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    for mode in ("sync", "async"):
        cfg = config(Path(out_dir) / mode, steps=3, parallel={"dp": 2, "heartbeat_s": 0}, async_save=mode == "async")
        Trainer(cfg).run()


def test_a_two_process_async_checkpoint_equals_the_synchronous_one(tmp_path):
    run_world(_sync_and_async, 2, tmp_path)
    for step in (1, 2, 3):
        a, b = (tmp_path / mode / "checkpoints" / step_name(step) for mode in ("sync", "async"))
        assert usable(b) is None
        assert len(entries(b)) == 6 and entries(a) == entries(b), f"step {step}: the same bytes in every file"
        assert same(load_part(a, "state"), load_part(b, "state"))
    assert not list((tmp_path / "async" / "checkpoints").glob(".tmp-*"))


def test_a_sharded_save_leaves_the_random_generator_untouched(tmp_path):
    """Building the plain model on the meta device (the index's shapes, at a process's first sharded save)
    drew from the CPU generator: dropout masks after a save differed from a resumed run's."""
    from meshlm.checkpoint import sharded
    from meshlm.families.registry import get_spec

    cfg = config(tmp_path).model
    spec = get_spec(cfg.family)
    sharded.plain_shapes.cache_clear()
    before = torch.get_rng_state()
    shapes = sharded.logical_shapes(cfg, spec=spec)
    sharded.fuse_logical({name: torch.zeros(shape) for name, shape in shapes.items()}, cfg, spec=spec)
    assert torch.equal(before, torch.get_rng_state())
