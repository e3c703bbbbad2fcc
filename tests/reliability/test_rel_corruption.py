"""Corrupt checkpoints and a broken `latest`: the newest valid checkpoint is used and the bad one named;
none valid stops with one line (exit 2) instead of starting over (issue 13)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from meshlm.checkpoint.files import read_manifest
from meshlm.checkpoint.single import load_model_state, load_part, resolve_checkpoint
from meshlm.cli import main
from meshlm.core.errors import CheckpointError
from meshlm.families.registry import get_spec
from meshlm.train.trainer import Trainer
from tests.conftest import ROOT
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)
from tests.reliability.trained_run import small  # the run behind the `run` and `copy` fixtures (conftest.py)

FILES = ("model.pt", "optim.pt", "state.pt", "config.json", "manifest.json")
KINDS = ("truncated", "emptied", "deleted", "flipped")


def corrupt(path, kind: str) -> None:
    """Replace (never modify in place: the run is hard-linked) `path` by a damaged copy."""
    data = path.read_bytes()
    path.unlink()
    if kind == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif kind == "emptied":
        path.write_bytes(b"")
    elif kind == "flipped":  # same size: only the checksum can tell
        mid = bytearray(data)
        for i in range(len(mid) // 2, len(mid) // 2 + 4):
            mid[i] ^= 0xFF
        path.write_bytes(bytes(mid))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", FILES)
def test_a_corrupt_file_falls_back_to_the_previous_checkpoint(copy, name, kind):
    corrupt(copy / "checkpoints" / "step_0000002" / name, kind)
    notes = []
    found = resolve_checkpoint(copy, log=notes.append)
    assert found.name == "step_0000001"
    assert len(notes) == 1 and "step_0000002, which is incomplete" in notes[0] and name in notes[0], notes
    assert load_model_state(found, spec=get_spec("gpt")).keys()


@pytest.mark.parametrize("name", ["model.pt", "state.pt"])
def test_training_resumes_from_the_previous_checkpoint_and_says_why(copy, name, capsys):
    corrupt(copy / "checkpoints" / "step_0000002" / name, "flipped")
    trainer = Trainer(small(copy, max_steps=3))
    assert trainer.step == 1
    out = capsys.readouterr().out
    assert f"checkpoints/latest names step_0000002, which is incomplete ({name}: checksum mismatch" in out
    assert "resuming from step_0000001" in out


@pytest.mark.parametrize("latest", ["deleted", "empty", "garbage", "missing step", "no config"])
def test_a_broken_latest_uses_the_newest_valid_checkpoint(copy, latest, capsys):
    pointer = copy / "checkpoints" / "latest"
    pointer.unlink()
    if latest in ("empty", "garbage", "missing step"):
        pointer.write_text({"empty": "", "garbage": "\x00\xffgarbage", "missing step": "step_0000040"}[latest])
    if latest == "no config":  # latest names step 2, whose config.json is gone: step 1 is the newest valid
        pointer.write_text("step_0000002\n")
        (copy / "checkpoints" / "step_0000002" / "config.json").unlink()
    trainer = Trainer(small(copy, max_steps=3))
    assert trainer.step == (1 if latest == "no config" else 2), "never a silent restart from step 1"
    assert "note: checkpoints/latest" in capsys.readouterr().out


def test_no_valid_checkpoint_stops_with_one_line_unless_resume_never(copy, capsys):
    for step in ("step_0000001", "step_0000002"):
        corrupt(copy / "checkpoints" / step / "model.pt", "truncated")
    args = ["train", "--config", "gpt-tiny", "--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32",
            "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.progress=false",
            f"--train.out_dir={copy}", "--train.max_steps=1", "--train.peak_tflops=1", "--train.sample_tokens=0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none is valid" in err and "train.resume=never" in err, err
    assert "step_0000002, which is incomplete (model.pt: size" in err
    assert main([*args, "--train.resume=never", "--train.keep_last=0"]) == 0
    fresh = resolve_checkpoint(copy)  # the new run's step 1 (the old, broken step 2 is passed over)
    assert fresh.name == "step_0000001" and load_part(fresh, "state")["tokens_seen"] == 2 * 32


def test_an_explicit_bad_step_directory_is_an_error_naming_the_problem(copy):
    step = copy / "checkpoints" / "step_0000002"
    corrupt(step / "optim.pt", "emptied")
    with pytest.raises(CheckpointError, match="optim.pt: size 0 != "):
        resolve_checkpoint(step)
    with pytest.raises(CheckpointError, match="incomplete"):
        load_model_state(step)  # the size check always runs


def test_generate_falls_back_with_a_message(copy):
    corrupt(copy / "checkpoints" / "step_0000002" / "model.pt", "flipped")
    proc = subprocess.run([sys.executable, "-m", "meshlm", "generate", "--checkpoint", str(copy), "--prompt", "A",
                           "--max-new-tokens", "2", "--seed", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "step_0000002, which is incomplete (model.pt: checksum mismatch" in proc.stderr
    assert "using" in proc.stderr and "step_0000001" in proc.stderr


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A 2-process (dp = 2) run's sharded checkpoints of steps 1 and 2."""
    out = tmp_path_factory.mktemp("sharded")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "meshlm",
           "train", "--config", "gpt-tiny", "--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32",
           "--train.micro_batch_size=2", "--train.global_batch_size=4", "--parallel.dp=2", "--train.max_steps=2",
           "--train.save_every=1", "--train.progress=false", "--train.peak_tflops=1", f"--train.out_dir={out}",
           "--parallel.timeout_s=60"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("name, kind", [("shards/rank00001.safetensors", "flipped"), ("shards/rank00000.pt", "truncated"),
                                        ("index.json", "deleted"), ("state.pt", "emptied")])
def test_a_corrupt_sharded_checkpoint_falls_back(sharded, tmp_path, name, kind):
    out = tmp_path / "run"
    shutil.copytree(sharded, out, copy_function=os.link)
    step2 = out / "checkpoints" / "step_0000002"
    assert {*read_manifest(step2)["files"]} == {
        "config.json", "index.json", "state.pt", "shards/rank00000.safetensors", "shards/rank00001.safetensors",
        "shards/rank00000.pt", "shards/rank00001.pt"}
    corrupt(step2 / name, kind)
    notes = []
    found = resolve_checkpoint(out, log=notes.append)
    assert found.name == "step_0000001" and name in notes[0], notes
    weights = load_model_state(found, spec=get_spec("gpt"))
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert Trainer(small(out, max_steps=3, global_batch_size=4)).step == 1  # one process resumes it
