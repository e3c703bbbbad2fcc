"""Does a checkpoint agree with itself? Its step (directory name, manifest, `state.pt`) and its weights' shapes
(against the shapes its own `config.json` implies). `files.verify` and `files.usable` call these; a
disagreement makes the checkpoint invalid like a torn file or a NaN weight, so readers fall back to the
previous valid step, naming why (docs/reliability.md, "Round 4").

The shapes a config implies come from the family's model class, built on the meta device; checkpoint/ never
looks a family up, so the caller passes `spec_of` (family name → `ModelSpec`, e.g. `families.registry.get_spec`).
Shapes are read from the files' headers where the format has them (safetensors, a parallel run's index) and
from a memory-mapped `torch.load` of `model.pt` (no tensor data is read).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from meshlm.core.config import config_from_dict
from meshlm.core.errors import CheckpointError
from meshlm.models.init import meta_device


def _state_step(path: Path) -> int | None:
    """The step `state.pt` records (None without a `state.pt`)."""
    f = path / "state.pt"
    if not f.is_file():
        return None
    try:
        state = torch.load(f, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 (torch.load raises RuntimeError, EOFError, UnpicklingError, ...)
        raise CheckpointError(f"state.pt cannot be read ({type(err).__name__})") from None
    step = state.get("step") if isinstance(state, dict) else None
    if type(step) is not int:
        raise CheckpointError("state.pt records no step")
    return step


def step_disagreement(path: Path, named: int | None, manifest_step: int) -> tuple[str, str] | None:
    """(what is wrong, verdict) when the step directory's name (its step `named`), its manifest's step and its
    `state.pt`'s step are not all the same, else None. The advice fits the disagreement: a rename only when
    the name alone differs; an edited manifest or state is never "fixed" by renaming the directory."""
    try:
        state = _state_step(path)
    except CheckpointError as err:
        return str(err), "is incomplete"
    steps = {"name": named, "manifest.json": manifest_step, "state.pt": state}
    known = {k: v for k, v in steps.items() if v is not None}
    if len(set(known.values())) <= 1:
        return None
    if named is not None and state in (None, manifest_step) and named != manifest_step:
        also = "" if state is None else " (its state.pt too)"
        return (f"its manifest.json is of step {manifest_step}, not {named}{also}: the directory was renamed; "
                f"rename it step_{manifest_step:07d} or move it out of checkpoints/"), "is misnamed"
    said = ", ".join(f"{'its name' if k == 'name' else k} says {v}" for k, v in known.items())
    odd = [k for k, v in known.items() if list(known.values()).count(v) == 1]
    edited = odd[0] if len(odd) == 1 and len(known) == 3 else "manifest.json or state.pt"
    return (f"{said}: {edited} was edited or copied from another step; restore the checkpoint or move it out "
            "of checkpoints/ (renaming it does not help)"), "disagrees about its step"


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of checkpoint `path`'s weights: `model.pt`, `model.safetensors`, or a parallel
    run's index (logical tensors: 2-D, rows × the rest)."""
    if (path / "model.pt").is_file():
        try:
            state = torch.load(path / "model.pt", map_location="meta", weights_only=False, mmap=True)
        except Exception as err:  # noqa: BLE001 (as above)
            raise CheckpointError(f"model.pt cannot be read ({type(err).__name__})") from None
        return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    if (path / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118 (not iterable)
    if (path / "index.json").is_file():
        shapes = json.loads((path / "index.json").read_text()).get("shapes", {})
        return {k: tuple(v) for k, v in shapes.items()}
    return {}


def implied_shapes(config: dict, spec_of: Callable, logical: bool) -> dict[str, tuple[int, ...]]:
    """The shapes `config` (a checkpoint's config.json) implies: the plain model's parameters, or with
    `logical` a parallel run's logical tensors (`sharded.logical_shapes`). The CPU random stream is left as
    it was (a meta build still draws from it)."""
    cfg = config_from_dict(config).model
    spec = spec_of(cfg.family)
    with torch.random.fork_rng(devices=[]), meta_device():
        model = spec.model_class(cfg)
    if not logical:  # what `model.state_dict()` holds: a tied tensor under each name, persistent buffers
        return {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    plain = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {lname: (shape[0] if rows < 0 else rows, *shape[1:])  # as `sharded.logical_shapes`
            for name, shape in plain.items() for lname, rows in spec.logical_blocks(name, cfg)}


def shape_mismatch(have: dict[str, tuple], want: dict[str, tuple]) -> tuple[str, tuple, tuple] | None:
    """(name, shape in `have`, shape in `want`) of the first tensor both hold whose shapes differ, or None.
    Only shared names are compared: a tuning run's checkpoint holds just the tensors it trains (and adapter
    tensors the plain model lacks), and a missing tensor is the loader's error, named there."""
    for name, shape in want.items():
        if name in have and have[name] != shape:
            return name, have[name], shape
    return None


def shape_text(shape: tuple | None) -> str:
    return "absent" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def shapes_disagreement(path: Path, config: dict, spec_of: Callable) -> str | None:
    """What is wrong when checkpoint `path`'s weights do not have the shapes its own config.json implies
    (one line naming the tensor and both shapes), else None."""
    logical = not (path / "model.pt").is_file() and not (path / "model.safetensors").is_file()
    try:
        have = weight_shapes(path)
        want = implied_shapes(config, spec_of, logical)
    except (CheckpointError, KeyError, ValueError) as err:
        return f"its weights' shapes cannot be read ({err})"
    if not have:
        return None
    bad = shape_mismatch(have, want)
    if bad is None:
        return None
    name, got, wanted = bad
    return (f"tensor {name!r} is {shape_text(got)} in its weights but its config.json implies {shape_text(wanted)}: "
            "the weights come from another model; restore this step or move it out of checkpoints/")


def run_disagreement(path: Path, run_config: dict, spec_of: Callable) -> str | None:
    """One line when checkpoint `path` (valid, its weights as its own config.json says) holds a model of
    another shape than the run about to resume it (`run_config`): the tensor, both shapes and the fix, in
    place of load_state_dict's 60-line "size mismatch" traceback. None when every shape agrees."""
    logical = not (path / "model.pt").is_file() and not (path / "model.safetensors").is_file()
    bad = shape_mismatch(weight_shapes(path), implied_shapes(run_config, spec_of, logical))
    if bad is None:
        return None
    name, got, wanted = bad
    return (f"checkpoint {path} holds a model of another shape: tensor {name!r} is {shape_text(got)} there and "
            f"{shape_text(wanted)} in this run's model; resume with the model.* settings of its config.json, or "
            "set train.out_dir to a new directory (or train.resume=never to start over there)")
