"""Bytes each rank sends per transformer layer per training step under tensor (and sequence) parallelism,
measured by wrapping torch.distributed's collectives, beside Megatron's theory.

Theory (Shoeybi et al. 2019; Korthikanti et al. 2022), per layer, forward + backward, activations of
b·s·h elements: TP does 4 all-reduces of b·s·h (2 forward `g`, 2 backward `f`); TP+SP does 4 all-gathers
and 4 reduce-scatters whose full tensors are b·s·h — plus, because the column-parallel linears (qkv, fc)
keep only the sequence shard of their input for the weight gradient, 2 all-gathers in backward that gather
it again (Megatron does the same, overlapped with the input-gradient matmul; the paper's "same bytes as TP"
counts the 8). With ring algorithms a rank sends 2(t−1)/t·N bytes per all-reduce of N bytes and (t−1)/t·N
per all-gather or reduce-scatter: TP 8(t−1)/t·b·s·h·bytes, TP+SP 10(t−1)/t·b·s·h·bytes (1.25×).
Forward and backward are counted apart, so the re-gathers show up as the backward's extra all-gathers.

Per-layer figures are the difference between a 2-layer and a 1-layer model (embedding, LM head,
cross-entropy and gradient synchronisation cancel out); what lies outside the layers is shown apart.

    .venv/bin/python benchmarks/tp_comm.py [--tp 2 4] [--batch 4 --seq 64 --hidden 64]
    .venv/bin/python benchmarks/tp_comm.py --smoke     # t = 2, b = 1, s = 16, h = 32
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.distributed as dist
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script
from world import run_world  # benchmarks/world.py, beside this script

from meshlm.core.config import ModelConfig
from meshlm.families.registry import spec_of
from meshlm.models.gpt import GPT
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.tensor import apply_tensor_parallel, finish_grads

WRAPPED = {"all_reduce": "all-reduce", "all_gather_single": "all-gather", "all_gather_into_tensor": "all-gather",
           "reduce_scatter_single": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter"}


class CommCounter:
    """Wraps the collectives on `torch.distributed`; counts calls, full-tensor elements and bytes sent."""

    def __init__(self):
        self.calls = collections.Counter()
        self.elements = collections.Counter()
        self.sent = collections.Counter()
        self._originals = {}

    def __enter__(self):
        for name, kind in WRAPPED.items():
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(self._originals[name], kind))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(dist, name, fn)

    def _wrap(self, fn, kind):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            t = dist.get_world_size(group)
            if kind == "all-reduce":
                full = args[0]
                sent = 2 * (t - 1) / t * full.numel() * full.element_size()
            else:  # all-gather: args (output, input); reduce-scatter: args (output, input): the big one
                full = args[0] if kind == "all-gather" else args[1]
                sent = (t - 1) / t * full.numel() * full.element_size()
            if full.numel() > 1:  # skip scalars (the grad-norm all-reduce)
                self.calls[kind] += 1
                self.elements[kind] += full.numel()
                self.sent[kind] += sent
            return fn(*args, **kwargs)

        return counted


def _one_step(cfg: ModelConfig, dims: ParallelDims, sp: bool, batch: int) -> tuple[CommCounter, ...]:
    """(collectives of the forward, of the backward, of `finish_grads`) for one micro-batch."""
    torch.manual_seed(0)
    model = GPT(cfg)
    loss_fn = apply_tensor_parallel(model, dims, sp, spec=spec_of(model))
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with CommCounter() as forward:
        loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
    with CommCounter() as backward:
        loss.backward()
    with CommCounter() as sync:
        finish_grads(model, dims)
    return forward, backward, sync


KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def _difference(two: CommCounter, one: CommCounter) -> dict[str, tuple]:
    """Per layer: (calls, elements, bytes sent) of a 2-layer minus a 1-layer model, by kind."""
    return {k: (two.calls[k] - one.calls[k], two.elements[k] - one.elements[k], two.sent[k] - one.sent[k])
            for k in KINDS}


def _measure_tp(args: argparse.Namespace, world: int) -> list:
    dims = ParallelDims.build(tp=world, timeout_s=120)
    rows = []
    for sp in (False, True):
        base = {"vocab_size": args.vocab, "hidden_size": args.hidden, "n_heads": args.heads, "seq_len": args.seq}
        one_fwd, one_bwd, one_sync = _one_step(ModelConfig(n_layers=1, **base), dims, sp, args.batch)
        two_fwd, two_bwd, two_sync = _one_step(ModelConfig(n_layers=2, **base), dims, sp, args.batch)
        phases = {"forward": _difference(two_fwd, one_fwd), "backward": _difference(two_bwd, one_bwd)}
        per_layer = {k: tuple(f + b for f, b in zip(phases["forward"][k], phases["backward"][k])) for k in KINDS}
        outside = {k: (2 * (one_fwd.calls[k] + one_bwd.calls[k]) - two_fwd.calls[k] - two_bwd.calls[k],
                       2 * (one_fwd.sent[k] + one_bwd.sent[k]) - two_fwd.sent[k] - two_bwd.sent[k]) for k in KINDS}
        sync = (two_sync.elements["all-reduce"] - one_sync.elements["all-reduce"],
                two_sync.sent["all-reduce"] - one_sync.sent["all-reduce"])
        rows.append((sp, per_layer, phases, outside, sync))
    return rows


def measure(tp: int, args: argparse.Namespace) -> list:
    return run_world(tp, _measure_tp, args, timeout_s=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.tp, args.batch, args.seq, args.hidden, args.vocab = [2], 1, 16, 32, 64
    bsh = args.batch * args.seq * args.hidden
    print(f"b={args.batch} s={args.seq} h={args.hidden} (b·s·h = {bsh:,} elements, fp32), gloo on CPU; "
          "per transformer layer, one forward + backward, bytes sent by each rank\n")
    print("| t | SP | collectives per layer, forward (measured) | backward (measured) | elements per collective "
          "| sent per rank (measured) | theory | measured / theory | SP vs TP (measured) | + SP grad sync per layer "
          "| outside the layers (embedding, LM head, cross-entropy) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        ring = (tp - 1) / tp * bsh * 4  # bytes a rank sends per all-gather or reduce-scatter of b·s·h fp32
        theory = {False: ("4 AR", 8 * ring), True: ("4 AG + 4 RS + 2 AG re-gather", 10 * ring)}
        sent_tp = None
        for sp, per_layer, phases, outside, sync in measure(tp, args):
            ops = {p: ", ".join(f"{n} {k}" for k, (n, _, _) in c.items() if n) for p, c in phases.items()}
            sizes = sorted({e // n for n, e, _ in per_layer.values() if n})
            sent = sum(s for _, _, s in per_layer.values())
            sent_tp = sent_tp or sent
            label, want = theory[sp]
            out = ", ".join(f"{n} {k} {s / 1e3:,.1f} kB" for k, (n, s) in outside.items() if n)
            print(f"| {tp} | {'on' if sp else 'off'} | {ops['forward']} | {ops['backward']} | "
                  f"{', '.join(f'{e:,}' for e in sizes)} | {sent / 1e3:,.1f} kB | {label}: {want / 1e3:,.1f} kB | "
                  f"{sent / want:.3f} | {sent / sent_tp:.2f}× | "
                  f"{f'{sync[0]:,} elements, {sync[1] / 1e3:.2f} kB' if sync[0] else '-'} | {out} |")

if __name__ == "__main__":
    main()
