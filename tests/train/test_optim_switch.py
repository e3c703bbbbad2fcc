"""Resuming a run under another `optim.name` (adamw ↔ muon): one clear error (exit code 2) that names what the
checkpoint was trained with, what is asked and the fix, decided from the optimizer state the checkpoint holds,
in both checkpoint formats; nothing on disk changes. The one-process runs go through `meshlm.cli.main` in
this process (what it prints on stderr and returns is what the console script prints and exits with)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import subprocess
import sys

import pytest
import torch

from meshlm.checkpoint import sharded
from meshlm.checkpoint.single import load_part, resolve_checkpoint
from meshlm.cli import main
from meshlm.core.errors import CheckpointError
from meshlm.train.trainer import Trainer
from tests.conftest import ROOT, tiny_config
from tests.train.test_resume import tiny_overrides

SWITCHES = [("adamw", "muon"), ("muon", "adamw")]


def _snapshot(root) -> dict[str, tuple[int, str]]:
    """Every file under `root`: modification time and content hash."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _train(*args: str) -> tuple[int, str]:
    """`meshlm train --config gpt-tiny ARGS` in this process: its exit code and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--config", "gpt-tiny", *args])
    return code, err.getvalue()


def _assert_switch_refused(out, trained: str, asked: str) -> None:
    before = _snapshot(out)
    code, stderr = _train(*tiny_overrides(out, max_steps=4), f"--optim.name={asked}")
    assert code == 2, stderr[-3000:]
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and stderr.count("\n") == 1, stderr[-3000:]
    assert f"trained with optim.name={trained}" in error and f"asks for optim.name={asked}" in error, error
    assert f"--optim.name={trained}" in error and "--train.init_from=" in error, error
    assert _snapshot(out) == before, "a refused resume must leave the run directory as it was"


@pytest.mark.parametrize("trained,asked", SWITCHES)
def test_switching_optimizer_on_a_one_process_checkpoint_is_one_clear_error(tmp_path, trained, asked):
    out = tmp_path / "run"
    code, stderr = _train(*tiny_overrides(out, max_steps=2), f"--optim.name={trained}")
    assert code == 0, stderr[-3000:]
    assert (resolve_checkpoint(out) / "optim.pt").exists()
    _assert_switch_refused(out, trained, asked)


@pytest.mark.parametrize("trained,asked", SWITCHES)
def test_switching_optimizer_on_a_sharded_checkpoint_is_one_clear_error(tmp_path, trained, asked):
    """A dp=2 run's pieces (`index.json`), resumed in one process under the other optimizer."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "meshlm",
           "train", "--config", "gpt-tiny", *tiny_overrides(out, max_steps=2), "--train.global_batch_size=4",
           "--parallel.dp=2", "--parallel.timeout_s=60", f"--optim.name={trained}"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sharded.is_sharded(resolve_checkpoint(out))
    _assert_switch_refused(out, trained, asked)


@pytest.mark.parametrize("trained,asked", SWITCHES)
def test_one_process_checkpoint_read_as_logical_tensors_refuses_the_switch(tmp_path, trained, asked):
    """`model.pt` + `optim.pt` loaded as a parallel run loads them (`sharded.load`): the optimizer is
    told from the saved param groups, not from config.json (here edited to lie)."""
    Trainer(tiny_config(tmp_path / "a", optim={"name": trained}, train={"max_steps": 2})).run()
    path = resolve_checkpoint(tmp_path / "a")
    (path / "config.json").write_text((path / "config.json").read_text().replace(f'"{trained}"', f'"{asked}"'))
    same = Trainer(tiny_config(tmp_path / "b", optim={"name": trained}, train={"resume": "never"}))
    sharded.load(path, same.sync, same.optimizer, spec=same.spec)  # the same optimizer: loads as before
    legacy = Trainer(tiny_config(tmp_path / "c", optim={"name": trained}, train={"resume": "never"}))
    legacy.optimizer.load_state_dict(load_part(path, "optim"))
    for p, q in zip(same.optimizer.param_groups, legacy.optimizer.param_groups, strict=True):
        for a, b in zip(p["params"], q["params"], strict=True):
            mine, theirs = same.optimizer.state[a], legacy.optimizer.state[b]
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k].float(), theirs[k].float()) for k in mine)
    other = Trainer(tiny_config(tmp_path / "d", optim={"name": asked}, train={"resume": "never"}))
    with pytest.raises(CheckpointError, match=f"--optim.name={trained}"):
        sharded.load(path, other.sync, other.optimizer, spec=other.spec)
