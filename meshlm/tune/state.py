"""A tune run's checkpoints: the trainable tensors only, whole, so they load under any layout.

An adapter is small (LoRA at rank 8 on q and v of gpt-tiny: 16k numbers), so a tune checkpoint is written
by rank 0 in the one-process format (`checkpoint/single.py`: `model.pt`, `optim.pt`, `state.pt`, atomic,
with a manifest): `model.pt` holds every trainable tensor whole (tensor-parallel parts gathered, the
pipeline stages' tensors collected), `optim.pt` the optimizer's state of each, whole as well, by name.
Loading, every rank takes its part of each whole tensor (`local_part`), whatever the layout was. The
base's weights are never written: they are read again from `tune.base` when a run starts or resumes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshlm.core.errors import CheckpointError, CheckpointWriteError, TrainingError
from meshlm.core.rng import rng_state, set_rng_state
from meshlm.parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear, Sharded, VocabParallelEmbedding
from meshlm.tune.adapters import trainable
from meshlm.tune.lora import LoRA


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def whole(model: nn.Module, name: str, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `local` is this rank's part of parameter `name` (or of a tensor shaped
    like it: an optimizer state). A collective over tp for a tp-split parameter: every tp rank calls it."""
    owner, attr = _owner(model, name)
    if isinstance(owner, LoRA):
        return owner.full_tensor(attr, local)
    if isinstance(owner, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) and \
            attr in owner.sharded_names and owner.tp > 1:
        saved = getattr(owner, attr).data
        try:  # full_weight gathers the module's own tensor: lend it `local` for the call
            getattr(owner, attr).data = local.detach()
            return owner.full_weight(attr).clone()
        finally:
            getattr(owner, attr).data = saved
    return local.detach().clone()


def local_part(model: nn.Module, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole tensor `full` of parameter `name`, on `like`'s device and dtype."""
    owner, attr = _owner(model, name)
    if isinstance(owner, LoRA):
        part = owner.local_slice(attr, full)
    elif isinstance(owner, Sharded):
        rows, cols = owner.shard_index(attr)
        part = full
        if rows is not None:
            padded = torch.zeros((int(rows.max()) + 1, *full.shape[1:]), dtype=full.dtype)
            padded[:full.shape[0]] = full
            part = padded[rows]
        if cols is not None:
            part = part[:, cols]
    else:
        part = full
    if tuple(part.shape) != tuple(like.shape):
        raise CheckpointError(f"the tune checkpoint's {name} has shape {tuple(full.shape)}, which does not fit this "
                              f"model (its part here is {tuple(like.shape)}); it was saved for another tune.* or "
                              "model.* setting")
    return part.to(device=like.device, dtype=like.dtype)


def _collect(sync, optimizer) -> tuple[dict, dict]:
    """This rank's trainable tensors and their optimizer states, whole; only the ranks that own them
    (dp rank 0, tp rank 0) return them, the others empty dicts. A collective over tp."""
    model, dims = sync.model, sync.dims
    weights, states = {}, {}
    for name, p in trainable(model).items():
        w = whole(model, name, p)
        st = {}
        for key, value in optimizer.state.get(p, {}).items():
            st[key] = whole(model, name, value) if torch.is_tensor(value) and value.shape == p.shape else value
        if dims.dp_rank == 0 and dims.tp_rank == 0:
            weights[name] = w.cpu()
            states[name] = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
    return weights, states


def gather_to_main(obj, dims):
    """Every rank's `obj` on rank 0 (a list there, None elsewhere); one process: [obj]."""
    if dims.world_size == 1:
        return [obj]
    out = [None] * dims.world_size if dims.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def save(trainer) -> Path:
    """Publish the trainable tensors, their optimizer states and the run state (a collective)."""
    from meshlm.checkpoint.single import save_checkpoint

    dims = trainer.dims
    weights, states = _collect(trainer.sync, trainer.optimizer)
    gathered = gather_to_main((weights, states, rng_state(), trainer.tp_rng.get_state()), dims)
    box = [None]
    if dims.is_main:
        all_w, all_s = {}, {}
        for w, s, _, _ in gathered:
            all_w.update(w)
            all_s.update(s)
        state = {**trainer.run_state(), "rng": [g[2] for g in gathered], "tp_rng": [g[3] for g in gathered]}
        try:
            box[0] = str(save_checkpoint(trainer.out_dir, trainer.step,
                                              {"model": all_w, "optim": all_s, "state": state}, trainer.cfg.to_dict()))
        except (OSError, RuntimeError, CheckpointError, CheckpointWriteError, TrainingError) as err:  # every rank raises the same
            box[0] = err
    if dims.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return Path(box[0])


@torch.no_grad()
def load(trainer, path: Path) -> None:
    """The trainable tensors, their optimizer states and the run state of tune checkpoint `path`."""
    from meshlm.checkpoint.files import load_torch
    from meshlm.checkpoint.single import load_part

    model, optimizer, dims = trainer.model, trainer.optimizer, trainer.dims
    weights = load_torch(path / "model.pt")
    states = load_torch(path / "optim.pt") if (path / "optim.pt").exists() else {}
    state = load_part(path, "state")
    mine = trainable(model)
    extra = sorted(set(weights) - {n for n in _all_trainable_names(trainer)})
    for name, p in mine.items():
        if name not in weights:
            raise CheckpointError(f"{path} holds no {name}: it is not a checkpoint of this tune run's adapter "
                                  f"(tune.method={trainer.cfg.tune.method!r}); use another train.out_dir")
        p.copy_(local_part(model, name, weights[name], p))
        if name in states:
            st = {}
            for key, value in states[name].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    st[key] = local_part(model, name, value, p).clone()
                elif torch.is_tensor(value):  # Adam's step: on the device for the fused (CUDA) kernel
                    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
                    st[key] = value.clone().to(p.device if on_device else "cpu")
                else:
                    st[key] = value
            optimizer.state[p] = st
    if extra and dims.is_main and dims.pp == 1:
        trainer.log(f"note: {path} holds tensors this run does not train ({', '.join(extra[:3])}); ignored")
    saved = state.get("layout")
    if saved == trainer.layout_summary() and len(state.get("rng", [])) == dims.world_size:
        set_rng_state(state["rng"][dims.rank])
        trainer.tp_rng.set_state(state["tp_rng"][dims.rank])
    elif saved is not None:
        trainer.log(f"resuming a tune checkpoint of layout {saved} under {trainer.layout_summary()}: adapter, optimizer and "
                    "data position carry over; dropout masks start new streams")
    trainer.restore_position(state)


def _all_trainable_names(trainer) -> list[str]:
    """Every rank's trainable names (a collective under pp, where stages hold different ones)."""
    names = list(trainable(trainer.model))
    if trainer.dims.world_size == 1:
        return names
    out = [None] * trainer.dims.world_size
    dist.all_gather_object(out, names)
    return [n for part in out for n in part]
