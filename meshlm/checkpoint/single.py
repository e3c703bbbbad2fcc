"""Checkpoints of one process, and reading a checkpoint of any format.

One process writes OUT_DIR/checkpoints/step_0000100/{model.pt, optim.pt, state.pt, config.json,
manifest.json}; a parallel run writes per-rank pieces instead (`sharded.py`). Both go through
`files.py`: written into a temporary directory with a CRC-32 of every file, the manifest last,
fsynced, renamed into place, then `checkpoints/latest` moved. Readers (`resolve_checkpoint`,
`latest_checkpoint`, training's `train.resume=auto`) take the newest usable checkpoint (`files.find_valid`:
complete by its format, matching its manifest, named for its step, finite weights), whatever `latest`
says, and say which one they passed over and why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshlm.checkpoint.files import (
    MANIFEST,
    any_checkpoint,
    begin_checkpoint,
    checkpoints_dir,
    find_valid,
    load_config_dict,
    load_torch,
    non_finite,
    publish_checkpoint,
    save_torch,
    state_nbytes,
    usable,
    verify,
    write_failure,
)
from meshlm.core.errors import CheckpointError, TrainingError
from meshlm.families.spec import ModelSpec

MODEL_FILES = ("model.pt", "model.safetensors", "index.json")  # one process, `meshlm convert`, a parallel run


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def save_checkpoint(out_dir: str | Path, step: int, parts: dict[str, Any], config: dict) -> Path:
    """Write `parts` (name → object, one file each), the config and the manifest; publish atomically.
    Refuses (TrainingError) a model with non-finite weights; a failed write (disk full) removes the
    partial directory and raises CheckpointWriteError naming the file and the bytes needed."""
    bad = non_finite(parts.get("model", {}))
    if bad:
        raise TrainingError(f"refusing to save step {step}: the model's weights hold NaN or inf ({', '.join(bad[:3])}"
                            f"{', ...' if len(bad) > 3 else ''}); the previous checkpoint is kept. Lower optim.lr "
                            "or raise optim.warmup_steps")
    tmp = begin_checkpoint(out_dir, step)
    files = {}
    try:
        for name, obj in parts.items():
            files[f"{name}.pt"] = save_torch(obj, tmp / f"{name}.pt")
        return publish_checkpoint(out_dir, step, tmp, config, files)
    except (OSError, RuntimeError) as err:
        if not tmp.exists():  # published: the failure came later (e.g. moving `latest`)
            raise
        raise write_failure(err, tmp, step, state_nbytes(parts)) from err


def find_checkpoint(out_dir: str | Path, checksum: bool = True, resume: bool = True, spec_of: Callable | None = None
                    ) -> tuple[Path | None, str | None, bool]:
    """(newest valid checkpoint or None, a note on what was passed over, whether any checkpoint exists)
    for a run directory. `resume` (training resuming it): a one-process checkpoint needs its optimizer and
    state too; valid with `checksum` includes finite weights (`files.usable`), with `spec_of` (family name →
    spec) weights of the shapes its config.json implies."""
    root = checkpoints_dir(out_dir)
    path, note = find_valid(root, checksum, resume, spec_of)
    return path, note, any_checkpoint(root)


def resolve_checkpoint(path: str | Path, log: Callable[[str], None] | None = _stderr,
                       spec_of: Callable | None = None) -> Path:
    """A run directory, its checkpoints/ directory, or one step directory → a complete, verified checkpoint.
    In a run directory the newest valid one is taken; what was passed over is logged. `spec_of` (family name
    → spec, e.g. `families.registry.get_spec`): its weights' shapes are checked against its config.json too."""
    p = Path(path)
    for run in [p] + ([p.parent] if p.name == "checkpoints" else []):
        root = checkpoints_dir(run)
        if root.is_dir() and any_checkpoint(root):
            found, note, _ = find_checkpoint(run, resume=False, spec_of=spec_of)
            if found is None:
                raise CheckpointError(f"no valid checkpoint in {root}: {note}; train again (train.resume=never "
                                      "starts over) or restore a copy")
            if note and log is not None:
                log(f"note: {note}; using {found}")
            return found
    if (p / MANIFEST).exists():
        problem = usable(p, spec_of=spec_of)
        if problem is not None:
            raise CheckpointError(f"checkpoint {p} {problem.verdict} ({problem}); pass its run directory to use the "
                                  "newest valid checkpoint")
        return p
    if (p / "config.json").exists() and any((p / name).exists() for name in MODEL_FILES):
        return p  # `meshlm convert --to-single` output, or a checkpoint from before manifests
    raise CheckpointError(f"no checkpoint at {str(p)!r}: expected a run directory with checkpoints/step_*, "
                          "or a checkpoints/step_* directory; train first or fix the path")


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest valid checkpoint of a run directory, or None (quietly)."""
    return find_checkpoint(out_dir)[0]


def _check_sizes(ckpt: Path) -> None:
    if (ckpt / MANIFEST).exists():
        problem = verify(ckpt, checksum=False)
        if problem is not None:
            raise CheckpointError(f"checkpoint {ckpt} {problem.verdict} ({problem}); use an earlier checkpoint")


def load_part(ckpt: Path, name: str, map_location: str | torch.device = "cpu") -> Any:
    return load_torch(Path(ckpt) / f"{name}.pt", map_location)


def load_model_state(ckpt: Path, map_location: str | torch.device = "cpu", *,
                     spec: ModelSpec | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict of a checkpoint directory not yet verified (training's `init_from`, tests):
    its file sizes are checked against its manifest, then `read_model_state`. `spec` (the family's) is needed
    for a parallel run's pieces."""
    ckpt = Path(ckpt)
    _check_sizes(ckpt)
    return read_model_state(ckpt, map_location, spec=spec)


def read_model_state(ckpt: Path, map_location: str | torch.device = "cpu", *,
                     spec: ModelSpec | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict of verified checkpoint `ckpt` (`resolve_checkpoint`): `model.pt`,
    `model.safetensors` (`meshlm convert --to-single`), or the pieces of a parallel run (`index.json`,
    assembled in this process by `sharded.full_model_state` with the family's `spec`, which the caller passes).
    Weights holding NaN or inf are refused, naming the tensor."""
    ckpt = Path(ckpt)
    state = _read_model_state(ckpt, map_location, spec)
    bad = non_finite(state)
    if bad:
        raise CheckpointError(f"checkpoint {ckpt} holds non-finite weights (tensor {bad[0]!r} holds NaN or inf); use "
                              "an earlier checkpoint (give the run directory to take the newest usable one)")
    return state


def _read_model_state(ckpt: Path, map_location: str | torch.device, spec: ModelSpec | None) -> dict[str, torch.Tensor]:
    if (ckpt / "model.pt").exists():
        return load_part(ckpt, "model", map_location)
    if (ckpt / "model.safetensors").exists():  # written by `meshlm convert --to-single`
        from safetensors.torch import load_file

        return load_file(str(ckpt / "model.safetensors"), device=str(map_location))
    if (ckpt / "index.json").exists():
        from meshlm.checkpoint.sharded import full_model_state
        from meshlm.core.config import config_from_dict

        if spec is None:
            raise TypeError(f"{ckpt} holds a parallel run's pieces: pass the family's spec to assemble them")
        state = full_model_state(ckpt, config_from_dict(load_config_dict(ckpt)).model, spec=spec)
        return {k: v.to(map_location) for k, v in state.items()}
    raise CheckpointError(f"checkpoint {str(ckpt)!r} holds none of {', '.join(MODEL_FILES)}; it is incomplete")


