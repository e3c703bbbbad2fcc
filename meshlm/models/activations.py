"""Measured activation memory: the bytes autograd keeps for backward, per transformer layer.

`measure_saved_activations` runs one forward pass (and the loss) under
`torch.autograd.graph.saved_tensors_hooks`. Every tensor an op saves for its backward passes through the
pack hook, which sorts it:

* a **parameter or buffer** (or a view of one, e.g. the `weight.t()` a linear saves, or a RoPE table
  slice) is model state, not an activation: skipped;
* an **autocast copy of a parameter** (the bf16 cast of an fp32 weight that a linear saves under
  `torch.autocast`) is counted apart as `param_copy_bytes`: it scales with the parameters, not the tokens;
* anything else is an **activation**, counted once per storage (`q`, `k`, `v` are views of one `qkv`
  output and cost that storage once; a storage saved again by a later op or layer is not counted again)
  and charged to the transformer layer whose forward was running when it was first saved, else to
  `outside_bytes` (embedding, final norm, head, loss).

The whole storage is counted, not the view's elements: a saved view keeps its whole base alive.

Recomputation composes: non-reentrant `torch.utils.checkpoint` installs its own (inner) hook for the ops
inside the checkpointed region, which keeps nothing, and saves the region's inputs itself through the
enclosing hook, so what is counted here is exactly what stays in memory between forward and backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ActivationReport:
    """Bytes saved for backward by one forward pass (one micro-batch), on this rank."""

    per_layer: list[int]  # by transformer layer, in model order
    outside_bytes: int = 0  # embedding, final norm, head, loss
    param_copy_bytes: int = 0  # autocast casts of parameters (not activations)
    saved_tensors: int = 0  # tensors passed to the pack hook (before de-duplication)
    details: list[list[tuple[str, tuple[int, ...], int]]] = field(default_factory=list)  # per layer, if asked

    @property
    def layers_total(self) -> int:
        return sum(self.per_layer)

    @property
    def total(self) -> int:
        return self.layers_total + self.outside_bytes

    def summary(self, formula: list[float] | None = None) -> str:
        """One line for the training log; `formula`: the per-layer bytes `core.memory` predicts."""
        per = self.per_layer
        same = len(set(per)) == 1
        layer_text = f"{_mib(per[0])}/layer × {len(per)}" if same and per else \
            "per layer [" + ", ".join(_mib(b) for b in per) + "]"
        text = (f"activations saved for backward (one micro-batch, this rank, eager): {layer_text} = "
                f"{_mib(self.layers_total)} in layers + {_mib(self.outside_bytes)} outside = {_mib(self.total)}")
        if formula:
            text += (f"; formula (docs/memory.md) {_mib(int(sum(formula)))} in layers, measured/formula "
                     f"{self.layers_total / sum(formula):.3f}")
        return text


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB" if n >= 2 ** 20 else f"{n / 1024:.1f} KiB"


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


_VIEWS = ("TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0")
_PARTS = ("SelectBackward0", "SliceBackward0")  # one slice of a stacked parameter: an expert's `experts.fc[e]`


def _is_param_copy(t: torch.Tensor, params: set[int]) -> bool:
    """A `.to(dtype)` of a parameter or of a slice of one (what autocast saves for a linear's weight: a layer's,
    or one expert's of the stacked experts, `models/moe.py`), seen through views."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    leaf = fn.next_functions[0][0]
    while leaf is not None and type(leaf).__name__ in _VIEWS + _PARTS:
        leaf = leaf.next_functions[0][0]
    return leaf is not None and id(getattr(leaf, "variable", None)) in params


class _LayerTracker:
    """Forward pre/post hooks that keep the index of the transformer layer now running (or None)."""

    def __init__(self, layers: list[nn.Module]):
        self.current: int | None = None
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._enter(i)))
            self.handles.append(layer.register_forward_hook(self._leave(i)))

    def _enter(self, i: int):
        def hook(module, args):
            self.current = i
        return hook

    def _leave(self, i: int):
        def hook(module, args, output):
            self.current = None
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def count_saved_activations(model: nn.Module, layers: list[nn.Module] | None = None,
                            details: bool = False) -> Iterator[ActivationReport]:
    """Count what autograd saves inside the `with` body; the report is filled in as ops run.

    `layers` defaults to `model.layers` (the transformer blocks of a GPT or of a pipeline stage; other
    families pass their own, `ModelSpec.pipeline.layers`).
    """
    layers = list(model.layers) if layers is None else layers
    report = ActivationReport(per_layer=[0] * len(layers), details=[[] for _ in layers] if details else [])
    state = [*model.parameters(), *model.buffers()]
    state_storages = {_storage_key(p) for p in state}
    params = {id(p) for p in model.parameters()}
    seen: set[tuple[str, int]] = set()
    tracker = _LayerTracker(layers)

    def pack(t: torch.Tensor) -> torch.Tensor:
        report.saved_tensors += 1
        key = _storage_key(t)
        if key in state_storages or key in seen:
            return t
        seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        if _is_param_copy(t, params):
            report.param_copy_bytes += nbytes
        elif tracker.current is None:
            report.outside_bytes += nbytes
        else:
            report.per_layer[tracker.current] += nbytes
            if details:
                report.details[tracker.current].append((str(t.dtype).removeprefix("torch."), tuple(t.shape), nbytes))
        return t  # keep the tensor itself: training through this context is unchanged

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield report
    finally:
        tracker.remove()


def measure_saved_activations(model: nn.Module, run: Callable[[], torch.Tensor],
                              layers: list[nn.Module] | None = None, details: bool = False) -> ActivationReport:
    """Run `run()` (a forward pass returning the loss) once under the counter and drop its graph.

    Dropout inside `run` draws from the random streams; `measure_model_activations` rolls them back.
    """
    with count_saved_activations(model, layers, details) as report:
        loss = run()
    del loss  # frees the graph and everything it saved
    return report


def measure_model_activations(model: nn.Module, loss_fn: Callable, micro_batch: int, seq_len: int, vocab_size: int,
                              autocast: contextlib.AbstractContextManager | None = None,
                              tp_rng=None, fused_loss: bool = False,
                              layers: list[nn.Module] | None = None, example=None) -> ActivationReport:
    """One training-mode forward and loss on random tokens (or the family's `example` batch), counted;
    every random stream left as it was.

    The loss is `loss_fn(model(x), y)`, or with `fused_loss` the model's own chunked head + loss
    (`model(x, targets=y)`, which saves no logits), as the trainer computes it.

    Dropout draws are rolled back (`fork_rng`, and the tensor-parallel stream `tp_rng` is restored), and no
    data is consumed, so measuring at the start of training changes nothing in the run. Under tensor
    parallelism every rank must call it (the forward communicates).
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    if example is not None:  # the family's own batch (`ModelSpec.example_batch`: BERT's inputs and targets)
        x, y = (v.to(device) for v in example(model.cfg, micro_batch, gen))
    else:
        ids = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=gen).to(device)
        x, y = ids[:, :-1], ids[:, 1:]
    tp_state = tp_rng.get_state() if tp_rng is not None else None
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type), (autocast or contextlib.nullcontext()):
            return measure_saved_activations(model, (lambda: model(x, targets=y)) if fused_loss
                                             else (lambda: loss_fn(model(x), y)), layers)
    finally:
        if tp_rng is not None:
            tp_rng.set_state(tp_state)
