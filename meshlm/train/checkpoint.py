"""Checkpoints written atomically, with a `latest` pointer.

Layout: OUT_DIR/checkpoints/step_000100/{model.pt, optim.pt, state.pt, config.json} (one process; a parallel
run writes per-rank pieces instead, see `dist_checkpoint.py`), and
OUT_DIR/checkpoints/latest holding the name of the newest complete one. A checkpoint is written into a
temporary directory, fsynced, then renamed into place; only then is `latest` replaced (write + rename).
A crash or SIGKILL at any moment therefore leaves `latest` naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from meshlm.errors import CheckpointError  # callers catch ckpt.CheckpointError

LATEST = "latest"
MODEL_FILES = ("model.pt", "model.safetensors", "index.json")  # one process, `meshlm convert`, a parallel run


def checkpoints_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def save_checkpoint(out_dir: str | Path, step: int, parts: dict[str, Any], config: dict) -> Path:
    """Write `parts` (name → object, one file each) and the config; atomically publish as `latest`."""
    tmp = begin_checkpoint(out_dir, step)
    for name, obj in parts.items():
        write_part(tmp, name, obj)
    return publish_checkpoint(out_dir, step, tmp, config)


def begin_checkpoint(out_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for step `step`'s files (several processes may write into it)."""
    root = checkpoints_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{step_name(step)}-"))


def write_part(tmp: Path, name: str, obj: Any) -> None:
    _save_file(obj, tmp / f"{name}.pt")


def publish_checkpoint(out_dir: str | Path, step: int, tmp: Path, config: dict) -> Path:
    """Add the config, then rename `tmp` into place and point `latest` at it. In a multi-process run only
    one process calls this, after every process has written its parts (a barrier)."""
    root = checkpoints_dir(out_dir)
    final = root / step_name(step)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _fsync_dir(tmp)
    if final.exists():  # a re-save of the same step (e.g. resumed then stopped at once)
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory, its checkpoints/ directory, or one step directory → that complete checkpoint."""
    p = Path(path)
    for root in (checkpoints_dir(p), p):
        if (root / LATEST).exists():
            target = root / (root / LATEST).read_text().strip()
            if (target / "config.json").exists():
                return target
    if (p / "config.json").exists() and any((p / name).exists() for name in MODEL_FILES):
        return p
    raise CheckpointError(f"no checkpoint at {str(p)!r}: expected a run directory with checkpoints/latest, "
                          "or a checkpoints/step_* directory; train first or fix the path")


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    try:
        return resolve_checkpoint(out_dir)
    except CheckpointError:
        return None


def load_part(ckpt: Path, name: str, map_location: str | torch.device = "cpu") -> Any:
    return torch.load(ckpt / f"{name}.pt", map_location=map_location, weights_only=False)


def load_model_state(ckpt: Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The whole model's state dict: `model.pt`, `model.safetensors` (`meshlm convert --to-single`), or the
    pieces of a parallel run (`index.json`, assembled by `dist_checkpoint.full_model_state` in this process)."""
    if (ckpt / "model.pt").exists():
        return load_part(ckpt, "model", map_location)
    if (ckpt / "model.safetensors").exists():  # written by `meshlm convert --to-single`
        from safetensors.torch import load_file

        return load_file(str(ckpt / "model.safetensors"), device=str(map_location))
    if (ckpt / "index.json").exists():
        from meshlm.config import config_from_dict
        from meshlm.train.dist_checkpoint import full_model_state

        state = full_model_state(ckpt, config_from_dict(load_config_dict(ckpt)).model)
        return {k: v.to(map_location) for k, v in state.items()}
    raise CheckpointError(f"checkpoint {str(ckpt)!r} holds none of {', '.join(MODEL_FILES)}; it is incomplete")


def load_config_dict(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def prune_temporaries(out_dir: str | Path) -> None:
    """Remove half-written temporaries left by a killed run (never a published checkpoint)."""
    root = checkpoints_dir(out_dir)
    if root.exists():
        for tmp in root.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
