"""The one door to a checkpoint for inference: open it once, then load the whole model or this rank's part.

`open_checkpoint(path)` resolves what the user gave (a run directory, its checkpoints/, one step directory,
or `meshlm convert --to-single` output) to one verified step directory, exactly once per command: the newest
valid checkpoint is taken and any fallback note ("passing over step N ...") is printed once. The frozen
`Checkpoint` it returns (what was given, the verified step directory, its `Config`, whether it holds a
parallel run's pieces) is what every lower function takes, never the path string again. Two loaders take
it, with the family's spec passed in (checkpoint/ never looks a family up):

* `load_model`: the whole model in one process, built on the meta device and given the checkpoint's
  tensors (`load_state_dict(assign=True)`), so no time goes into an initialisation that is overwritten;
* `load_parallel`: this rank's part under a layout (`build_model` + `sharded.load_matching_weights`),
  for a checkpoint of any training layout.

Other formats (a `.gguf` file) come in through `meshlm.interop.checkpoints.open_checkpoint`, which converts
them to a run directory first and then opens it here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from meshlm.checkpoint.files import load_config_dict
from meshlm.checkpoint.sharded import is_sharded, load_matching_weights, plain_buffers
from meshlm.checkpoint.single import read_model_state, resolve_checkpoint
from meshlm.core.config import Config, config_from_dict
from meshlm.core.errors import CheckpointError
from meshlm.families.spec import ModelSpec
from meshlm.models.init import meta_device


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Checkpoint:
    """A resolved, verified checkpoint: what the user gave (`given`, for messages), the step directory
    (`path`), the run's `Config` saved with it, and whether it holds a parallel run's pieces (`sharded`)."""

    given: str
    path: Path
    config: Config
    sharded: bool


def open_checkpoint(path: str | Path, log: Callable[[str], None] | None = _stderr,
                    spec_of: Callable[[str], ModelSpec] | None = None) -> Checkpoint:
    """Resolve and verify `path` once (`single.resolve_checkpoint`: sizes, checksums, finite weights, with
    `spec_of` (family name → spec) the weights' shapes against its config.json; a note on what was passed
    over goes to `log`) and read its config."""
    found = resolve_checkpoint(path, log=log, spec_of=spec_of)
    return Checkpoint(str(path), found, config_from_dict(load_config_dict(found)), is_sharded(found))


def load_model(checkpoint: Checkpoint, spec: ModelSpec, device: str | torch.device = "cpu",
               log: Callable[[str], None] | None = _stderr) -> nn.Module:
    """The plain model of `checkpoint` (any layout, family `spec`) in eval mode on `device`: built on the
    meta device and given the checkpoint's tensors, buffers initialised on `device` and then set to the
    saved ones. A parallel run's checkpoint written before buffers were saved has none: they keep their
    initial values (a note to `log`)."""
    device = torch.device(device)
    state = read_model_state(checkpoint.path, device, spec=spec)
    with meta_device():
        model = spec.model_class(checkpoint.config.model)
    tied = _tied_names(model)
    absent = {name: torch.zeros(t.shape, dtype=t.dtype, device=device)  # set by `init_buffers` below
              for name, t in plain_buffers(checkpoint.config.model, spec=spec).items() if name not in state}
    if absent and log is not None:
        log(f"checkpoint {checkpoint.given} holds no buffers (it predates their saving): "
            f"{', '.join(sorted(absent))} keep their initial values")
    model.load_state_dict({**state, **absent}, strict=True, assign=True)
    for first, *others in tied:  # `assign` gave each name its own Parameter: tie them again
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    saved = {name: state[name].clone() for name, _ in model.named_buffers() if name in state}
    model.init_buffers(device)  # computed buffers (RoPE tables) ...
    model.load_state_dict(saved, strict=False)  # ... but the saved ones (a sigmoid router's score_bias) as saved
    return model.eval()


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one Parameter (tied weights, e.g. a head tied to the embedding)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def load_parallel(checkpoint: Checkpoint, spec: ModelSpec, cfg: Config, dims, rng=None):
    """This rank's part of `checkpoint`'s model under the layout of `cfg` (the checkpoint's model, the
    caller's `parallel` section) and `dims` (an initialised `ParallelDims`), in eval mode: `Parallelized`.
    The checkpoint may come from any layout; its tensors are resharded to this one. Collective: every rank
    calls it. CheckpointError when the checkpoint lacks some of the model's tensors."""
    from meshlm.parallel import build_model

    par = build_model(cfg, dims, rng=rng, spec=spec)
    missing = load_matching_weights(checkpoint.path, par.grad_sync, checkpoint.config.model, spec=spec)
    if missing:
        raise CheckpointError(f"{checkpoint.given}: the checkpoint lacks {', '.join(missing)}; it is not a whole "
                              "model of this shape")
    par.model.eval()
    for stage in (par.pipeline.modules if par.pipeline is not None else []):
        stage.eval()
    return par
