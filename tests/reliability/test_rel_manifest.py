"""A manifest must not vouch for itself (issue 35, items 5-9): it must list every file the checkpoint needs,
an empty list is a bad checkpoint like any other, a renamed step directory is refused, a `latest` that is a
directory is left alone, and non-finite weights under a recomputed manifest are found at load."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import meshlm.checkpoint.sharded
from meshlm.checkpoint.files import file_crc32, verify
from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.cli import main
from meshlm.core.errors import CheckpointError
from meshlm.train.trainer import Trainer
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)
from tests.reliability.trained_run import small  # the run behind the `run` and `copy` fixtures (conftest.py)

STEP1, STEP2 = "step_0000001", "step_0000002"


def replace(path, data: bytes) -> None:
    """Write `path` anew (never in place: the copy is hard-linked to the module's run)."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def flip(path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 4):
        data[i] ^= 0xFF
    replace(path, bytes(data))


def edit_manifest(step_dir, drop=(), recompute=(), files=None) -> None:
    """Rewrite `step_dir`'s manifest: entries dropped, entries recomputed from the files as they are now."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in drop:
        del manifest["files"][name]
    for name in recompute:
        manifest["files"][name] = {"size": (step_dir / name).stat().st_size,
                                   "crc32": file_crc32(step_dir / name)}
    if files == "absent":
        del manifest["files"]
    elif files is not None:
        manifest["files"] = files
    replace(step_dir / "manifest.json", json.dumps(manifest).encode())


def resumed_step(out, capsys) -> tuple[int, str]:
    trainer = Trainer(small(out, max_steps=3))
    return trainer.step, capsys.readouterr().out


# ---- 5: the manifest lists every file the checkpoint needs -------------------------------------------------
@pytest.mark.parametrize("kind", ["flipped", "deleted"])
@pytest.mark.parametrize("name", ["model.pt", "optim.pt", "state.pt", "config.json"])
def test_a_file_left_out_of_the_manifest_makes_the_checkpoint_invalid(copy, name, kind, capsys):
    step2 = copy / "checkpoints" / STEP2
    edit_manifest(step2, drop=[name])
    flip(step2 / name) if kind == "flipped" else (step2 / name).unlink()
    step, out = resumed_step(copy, capsys)
    assert step == 1, "a file the manifest does not list must not be trusted"
    assert f"names {STEP2}, which is incomplete ({name} is not in manifest.json" in out, out
    assert out.count("note:") == 1 and f"resuming from {STEP1}" in out


def test_generate_needs_only_the_model_and_config_but_never_an_unlisted_model(copy):
    step2 = copy / "checkpoints" / STEP2
    edit_manifest(step2, drop=["optim.pt"])
    (step2 / "optim.pt").unlink()  # a weights-only checkpoint: fine for reading the model
    assert resolve_checkpoint(copy, log=None).name == STEP2
    edit_manifest(step2, drop=["model.pt"])
    notes = []
    assert resolve_checkpoint(copy, log=notes.append).name == STEP1
    assert "model.pt is not in manifest.json" in notes[0]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Sharded (parallel-format) checkpoints of steps 1 and 2, written in this process (one rank)."""
    out = tmp_path_factory.mktemp("sharded")
    trainer = Trainer(small(out, save_every=0, max_steps=1, keep_last=0))
    for step in (1, 2):
        trainer.step = step
        rank_state = {"rng": torch.get_rng_state(), "tp_rng": trainer.tp_rng.get_state()}
        meshlm.checkpoint.sharded.save(out, step, trainer.sync, trainer.optimizer, trainer.run_state(),
                                       trainer.cfg.to_dict(), rank_state, spec=trainer.spec)
    return out


@pytest.mark.parametrize("name", ["shards/rank00000.safetensors", "shards/rank00000.pt", "index.json", "state.pt"])
def test_a_sharded_checkpoint_needs_every_shard_its_index_names(sharded, tmp_path, name):
    out = tmp_path / "run"
    shutil.copytree(sharded, out, copy_function=os.link)
    step2 = out / "checkpoints" / STEP2
    edit_manifest(step2, drop=[name])
    (step2 / name).unlink()
    notes = []
    assert resolve_checkpoint(out, log=notes.append).name == STEP1
    assert f"{name} is not in manifest.json" in notes[0] or (name == "index.json" and "model.pt" in notes[0]), notes
    assert json.loads((out / "checkpoints" / STEP1 / "index.json").read_text())["ranks"] == 1  # every rank's files


# ---- 6: an empty or malformed file list is an invalid checkpoint, not the end of the run -----------------------
@pytest.mark.parametrize("files", [{}, [], "absent", {"model.pt": "x"}])
def test_an_empty_or_malformed_file_list_falls_back(copy, files, capsys):
    edit_manifest(copy / "checkpoints" / STEP2, files=files)
    step, out = resumed_step(copy, capsys)
    assert step == 1
    assert f"names {STEP2}, which is incomplete (" in out and f"resuming from {STEP1}" in out, out


# ---- 7: a step directory named after another step ------------------------------------------------------------
def test_a_step_directory_named_for_a_later_step_is_refused(copy, capsys):
    root = copy / "checkpoints"
    shutil.copytree(root / STEP1, root / "step_0000999", copy_function=os.link)
    step, out = resumed_step(copy, capsys)
    assert step == 2, "the newest consistently named checkpoint wins, not a renamed copy of step 1"
    assert "step_0000999 is misnamed (its manifest.json is of step 1, not 999" in out, out
    with pytest.raises(CheckpointError, match="misnamed"):
        resolve_checkpoint(root / "step_0000999")


# ---- 8: `latest` is a directory ------------------------------------------------------------------------------
def test_a_latest_directory_is_left_alone_and_training_saves(copy, capsys):
    latest = copy / "checkpoints" / "latest"
    latest.unlink()
    latest.mkdir()
    (latest / "mine.txt").write_text("user data")
    trainer = Trainer(small(copy, max_steps=3))
    assert trainer.step == 2
    trainer.run()
    captured = capsys.readouterr()
    assert "checkpoints/latest is a directory" in captured.out
    assert captured.err.count("latest is a directory") == 1, captured.err
    assert (latest / "mine.txt").read_text() == "user data"
    assert resolve_checkpoint(copy, log=None).name == "step_0000003"


def test_a_latest_directory_alone_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "latest").mkdir(parents=True)
    assert Trainer(small(tmp_path, max_steps=1)).step == 0


# ---- 9: non-finite weights under a recomputed manifest -------------------------------------------------------
def poison(step_dir) -> str:
    state = torch.load(step_dir / "model.pt", weights_only=True)
    name = min(k for k, v in state.items() if v.is_floating_point())
    state[name].view(-1)[0] = float("nan")
    (step_dir / "model.pt").unlink()
    torch.save(state, step_dir / "model.pt")
    edit_manifest(step_dir, recompute=["model.pt"])
    assert verify(step_dir) is None  # the manifest vouches for it
    return name


def test_non_finite_weights_fall_back_and_are_named(copy, capsys):
    name = poison(copy / "checkpoints" / STEP2)
    step, out = resumed_step(copy, capsys)
    assert step == 1
    assert f"{STEP2}, which holds non-finite weights (model.pt: tensor {name!r} holds NaN or inf" in out, out


def test_generate_and_convert_refuse_a_step_with_non_finite_weights(copy, tmp_path, capsys):
    step2 = copy / "checkpoints" / STEP2
    name = poison(step2)
    assert main(["generate", "--checkpoint", str(step2), "--prompt", "A", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and STEP2 in err and name in err and "NaN or inf" in err, err
    assert main(["convert", "--checkpoint", str(step2), "--to-single", str(tmp_path / "single")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and "NaN or inf" in err, err
    assert not (tmp_path / "single").exists()
    assert resolve_checkpoint(copy, log=None).name == STEP1  # the run directory falls back


def test_non_finite_sharded_weights_fall_back(sharded, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    shutil.copytree(sharded, out, copy_function=os.link)
    step2 = out / "checkpoints" / STEP2
    shard = step2 / "shards" / "rank00000.safetensors"
    tensors = load_file(str(shard))
    key = min(k for k in tensors if k.startswith("weight/"))
    tensors[key].view(-1)[0] = float("inf")
    shard.unlink()
    save_file(tensors, str(shard))
    edit_manifest(step2, recompute=["shards/rank00000.safetensors"])
    notes = []
    assert resolve_checkpoint(out, log=notes.append).name == STEP1
    assert f"tensor {key.split('/')[1]!r} holds NaN or inf" in notes[0], notes
