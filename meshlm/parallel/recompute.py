"""Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022), from outside the model.

`apply_recompute(model, cfg)` wraps parts of a (possibly tensor-parallel) model or pipeline stage in
non-reentrant `torch.utils.checkpoint`: their forward runs without keeping what its backward needs, and
the backward runs the forward again to get it back. `train.recompute` picks what:

* **selective** — only the attention core `softmax(QKᵀ/√d)·V` (the layer methods the family's
  `ModelSpec.selective_recompute` names, GPT's `attn.core`). Its saved tensors are
  the `s×s` scores, softmax and dropout mask when the SDPA backend materialises them (Korthikanti's
  `5·a·s²·b` bytes per layer, the biggest term at long sequences), and costs only the `4·b·s²·h` FLOPs
  of its two batched matmuls to redo. What stays saved is the core's inputs q, k, v (which live anyway as
  the `qkv` output) and its output (the projection's input). The region holds no collective: under tensor
  and sequence parallelism the core sits between the column-parallel `qkv` and the row-parallel `proj`
  on this rank's heads, so recomputing it re-gathers nothing.
* **full** — whole transformer layers (Megatron's `--recompute-granularity full`). Only each region's
  input (the residual stream, `s·b·h` elements, `/t` under sequence parallelism) is saved; backward
  redoes the whole forward of the region, collectives included: under sequence parallelism each
  recomputed layer all-gathers its two column-parallel inputs (qkv, fc) and reduce-scatters its two
  row-parallel outputs again (checkpoint's early stop skips the last reduce-scatter when nothing after it
  is saved, i.e. without dropout). `train.recompute_method`:
  - `uniform`: the stage's layers in consecutive chunks of `recompute_num_layers` (0: 1), each chunk
    one checkpoint region: one saved input per chunk, but backward holds a whole chunk's activations.
  - `block`: the first `recompute_num_layers` layers of the stage (0: all), each its own region; the rest
    are not recomputed (spend memory where a pipeline stage has it to spare: the last stages hold fewer
    micro-batches in flight than the first).

Random streams are replayed exactly, so recomputing changes no number: `torch.utils.checkpoint` restores
the default generator (CPU, and CUDA of the inputs' devices) for the recomputation; the tensor-parallel
stream (`TPRNGTracker`, which dropout inside TP regions draws from) is not a generator torch knows of, so
`_replay_tp_stream` snapshots it when a region runs forward and sets it back for the recomputation,
then restores where the live stream had got to.

Checkpointing is skipped when gradients are off (evaluation, generation) and for KV-cache decoding.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from meshlm.core.config import Config, ConfigError
from meshlm.core.layout import RECOMPUTE_MODES as MODES
from meshlm.core.layout import check_compiled_recompute, full_recompute_chunks
from meshlm.families.spec import ModelSpec
from meshlm.parallel.rng import TPRNGTracker


def _replay_tp_stream(rng: TPRNGTracker) -> Callable[[], tuple]:
    """checkpoint's `context_fn`: a (forward, recompute) pair of context managers per region call.

    Forward records the TP stream's state on entry; recompute sets it back to that state (so the same
    dropout masks are drawn again) and, on exit, restores the live state, which went on from the forward.
    """

    def context_fn():
        snapshot: dict = {}

        @contextmanager
        def forward() -> Iterator[None]:
            snapshot.update(rng.get_state())
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            live = rng.get_state()
            rng.set_state(snapshot)
            try:
                yield
            finally:
                rng.set_state(live)

        return forward(), recompute()

    return context_fn


def _checkpointed(fn: Callable, context_fn) -> Callable:
    """`fn` run under non-reentrant checkpoint when autograd records (else as is)."""
    # torch.compile traces checkpoint only without a context_fn (or with TorchDispatchMode ones).
    extra = {} if context_fn is noop_context_fn else {"context_fn": context_fn}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)

    return run


def _recompute_methods(layers: list[nn.Module], paths: tuple[str, ...], context_fn) -> None:
    """Selective: each layer's methods at `paths` (e.g. `attn.core`: plain, or tensor parallel's
    per-rank-stream wrapper) run inside a checkpoint; their arguments are the saved inputs."""
    for layer in layers:
        for path in paths:
            owner_path, _, name = path.rpartition(".")
            owner = layer.get_submodule(owner_path) if owner_path else layer
            setattr(owner, name, _checkpointed(getattr(owner, name), context_fn))


def _recompute_chunk(chunk: list[nn.Module], context_fn) -> None:
    """Full: one checkpoint region over consecutive layers, without renaming any parameter.

    The model calls each layer in turn (`run_layers`), so the region is set up on the layers' own
    `forward`s: the chunk's first layer runs the whole chunk inside the checkpoint and returns its output;
    the other layers, handed exactly that output, pass it on (their work is done). Every layer gets the
    same extra arguments (positions, RoPE tables). Called without gradients (evaluation, decoding with a
    KV cache) or with another input, every layer runs its own forward.
    """
    forwards = [layer.forward for layer in chunk]  # the bound, unwrapped forwards
    last_output: list[torch.Tensor | None] = [None]

    def run_chunk(x, *args, **kwargs):
        for forward in forwards:
            x = forward(x, *args, **kwargs)
        return x

    region = _checkpointed(run_chunk, context_fn)

    def head(x, *args, **kwargs):
        if not torch.is_grad_enabled():
            last_output[0] = None
            return forwards[0](x, *args, **kwargs)
        out = region(x, *args, **kwargs)
        last_output[0] = out if len(chunk) > 1 else None
        return out

    chunk[0].forward = functools.wraps(forwards[0])(head)
    for i, (forward, layer) in enumerate(zip(forwards[1:], chunk[1:]), start=2):
        is_last = i == len(chunk)

        def tail(x, *args, _forward=forward, _last=is_last, **kwargs):
            if x is last_output[0] and torch.is_grad_enabled():
                if _last:
                    last_output[0] = None  # hold no reference past the chunk
                return x  # computed by the chunk's first layer, inside the region
            return _forward(x, *args, **kwargs)

        layer.forward = functools.wraps(forward)(tail)


_RECOMPUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its mode (applied once)


def apply_recompute(model: nn.Module, cfg: Config, rng: TPRNGTracker | None = None, *, spec: ModelSpec) -> None:
    """Wrap the layers of a model (its family's `PipelinePlan.layers`) or of a pipeline stage (`layers`)
    for `cfg.train.recompute`.

    In place; parameter names are unchanged. `rng` is the tensor-parallel dropout stream, replayed in the
    recomputation when the model has dropout (None: no TP stream is in use).
    """
    t = cfg.train
    if t.recompute not in MODES:
        raise ConfigError(f"train.recompute={t.recompute!r} is not one of {', '.join(MODES)}; pick one of them")
    if t.recompute == "none":
        return
    if model in _RECOMPUTED:
        raise RuntimeError(f"recomputation is already applied to this model ({_RECOMPUTED[model]})")
    container = model.layers if getattr(model, "is_stage", False) else getattr(model, spec.pipeline.layers)
    layers = [m for m in container if m is not None]
    # No TP stream, or no dropout to draw from it: the plain checkpoint (which torch.compile also takes).
    context_fn = _replay_tp_stream(rng) if rng is not None and cfg.model.dropout > 0 else noop_context_fn
    check_compiled_recompute(cfg, context_fn is not noop_context_fn)  # (core/layout.py: plan_layout asks it too)
    # GPT's multi-token prediction blocks (models/mtp.py; a last stage holds them): recomputed as the layers are
    # when every layer is (selective, or full with recompute_num_layers 0: each alone), as the planner counts them
    extra = [module.block for module in getattr(model, "mtp", None) or ()]
    if t.recompute == "selective":
        _recompute_methods(layers + extra, spec.selective_recompute, context_fn)
    else:
        for chunk in full_recompute_chunks(len(layers), t.recompute_method, t.recompute_num_layers):
            _recompute_chunk([layers[i] for i in chunk], context_fn)
        for block in extra if not t.recompute_num_layers else ():
            _recompute_chunk([block], context_fn)
    _RECOMPUTED[model] = t.recompute
