"""Context parallelism: the activation bytes each cp rank saves for backward, and the bytes it sends around
the ring per layer, measured, beside `core.memory`'s formulas (docs/memory.md, "Context parallelism").

For each cp, a gloo world of cp processes builds a Llama-style model as training does (`build_model`: the
ring in every layer's attention, each rank running its two chunks of every row), runs one forward with the
fused head + loss and one backward on a micro-batch of whole rows, and counts on every rank:

* **activations**: what autograd saves for backward in the transformer layers, with the saved-tensor
  counter the trainer and `meshlm bench memory` use (`models.activations.count_saved_activations`), against
  `activation_bytes_per_rank(...)["layers"]` (every saved term at this rank's s/cp tokens, no s×s scores);
* **ring traffic**: the bytes of every tensor the rank passes to an `isend` of `dist.batch_isend_irecv`
  (wrapped here, in the benchmark only), in forward and in backward, per layer, against `ring_send_bytes`
  (forward cp − 1 blocks of K and V; backward cp − 1 blocks of K and V and cp blocks of dK and dV, fp32);
* the process's peak resident memory (`ru_maxrss`), and its resident memory before the forward.

    .venv/bin/python benchmarks/context_parallel.py                     # seq 8,192, cp 1, 2, 4
    .venv/bin/python benchmarks/context_parallel.py --seq 1024 --cp 1 2 --layers 2
    .venv/bin/python benchmarks/context_parallel.py --smoke             # seq 64 at cp 2, one small layer
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import time

import torch
import torch.distributed as dist
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script
from world import run_world  # benchmarks/world.py, beside this script

from meshlm.core.config import Config, load_config
from meshlm.core.memory import (
    activation_bytes_per_rank,
    activation_dtypes,
    attention_backend,
    ring_buffer_bytes,
    ring_send_bytes,
)
from meshlm.families.registry import get_spec
from meshlm.models.activations import count_saved_activations
from meshlm.models.loss import use_fused_loss
from meshlm.parallel import TPRNGTracker, build_model, init_distributed


def bench_config(seq: int, cp: int, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                 vocab: int = 512, micro_batch: int = 1) -> Config:
    """llama-tiny's block (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases) at this size, fp32."""
    return load_config("llama-tiny", [
        f"--model.seq_len={seq}", f"--model.n_layers={layers}", f"--model.hidden_size={hidden}",
        f"--model.n_heads={heads}", f"--model.n_kv_heads={kv_heads}", f"--model.vocab_size={vocab}",
        f"--train.micro_batch_size={micro_batch}", f"--train.global_batch_size={micro_batch}",
        "--train.precision=fp32", f"--parallel.cp={cp}"])


class SendCounter:
    """Wraps `torch.distributed.batch_isend_irecv` while active: sums, by phase, the bytes of the tensors
    passed to its `isend` ops (what this rank puts on the wire) and counts them."""

    def __init__(self):
        self.phase = "forward"
        self.bytes = {"forward": 0, "backward": 0}
        self.sends = {"forward": 0, "backward": 0}
        self._original = None

    def __enter__(self):
        self._original = original = dist.batch_isend_irecv

        def counted(ops):
            for op in ops:
                if op.op is dist.isend:
                    self.bytes[self.phase] += op.tensor.numel() * op.tensor.element_size()
                    self.sends[self.phase] += 1
            return original(ops)

        dist.batch_isend_irecv = counted
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self._original


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure_rank(cfg: Config) -> dict:
    """One forward (fused head + loss) and backward of one micro-batch on this rank of a cp world (or one
    process at cp = 1), counted; the measured numbers beside the formulas. Every rank must call it."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    dims = init_distributed(p, torch.device("cpu"))
    torch.manual_seed(t.seed)
    spec = get_spec(m.family)
    par = build_model(cfg, dims, rng=TPRNGTracker(t.seed, dims.tp_rank, dims.device), spec=spec)
    model, layers = par.model, list(getattr(par.model, spec.pipeline.layers))
    ids = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    fused = use_fused_loss(cfg, dims.device) and spec.fused_loss
    rss_before, start = _rss_bytes(), time.perf_counter()
    with SendCounter() as sent:
        with count_saved_activations(model, layers) as saved:
            loss = model(x, targets=y) if fused else par.loss_fn(model(x), y)
        sent.phase = "backward"
        loss.backward()
    seconds = time.perf_counter() - start
    dtypes, backend = activation_dtypes("fp32", "cpu"), attention_backend("cpu", m.dropout)
    formula = activation_bytes_per_rank(m, t.micro_batch_size, m.n_layers, dtypes=dtypes, backend=backend,
                                        recompute=t.recompute, cp=p.cp)
    ring = ring_send_bytes(m, t.micro_batch_size, cp=p.cp, dtypes=dtypes)
    # the ring runs each block in plain ops, which materialise its (s/cp)² scores (the math kernel's term)
    scores = ring_buffer_bytes(m, t.micro_batch_size, cp=p.cp, dtypes=dtypes, backend="math")
    n = m.n_layers
    return {"cp": p.cp, "rank": dims.cp_rank if p.cp > 1 else 0, "layers": n, "seq": m.seq_len,
            "measured": saved.layers_total, "formula": formula["layers"], "outside": saved.outside_bytes,
            "ring_buffers": formula["total"] - formula["layers"],
            "sent_forward": sent.bytes["forward"] / n, "sent_backward": sent.bytes["backward"] / n,
            "sends_forward": sent.sends["forward"] / n, "sends_backward": sent.sends["backward"] / n,
            "ring_forward": ring["forward"], "ring_backward": ring["backward"], "block": ring["block"],
            "score_block": scores.get("ring score block in flight", 0.0), "rss_before": rss_before, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "seconds": seconds, "loss": float(loss.detach())}


def _world_fn(args: argparse.Namespace, world: int) -> list[dict] | None:
    """On every rank of a world of `world` = cp processes: `measure_rank`; rank 0 gets every rank's row."""
    row = measure_rank(bench_config(args.seq, world, args.layers, args.hidden, args.heads, args.kv_heads,
                                    args.vocab, args.batch))
    rows = [None] * world
    dist.all_gather_object(rows, row)
    return rows


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.2f}"


def table(rows: list[dict]) -> str:
    """The Markdown tables: activations per rank, ring bytes per layer per rank, memory and time."""
    by_cp = {r["cp"]: r["measured"] for r in rows if r["rank"] == 0}
    one = by_cp.get(1)
    lines = [("| cp | rank | saved in layers, measured (MiB) | formula (MiB) | measured / formula | share of cp 1 "
              "| measured − formula per layer (bytes) | outside layers (MiB) | ring K/V buffers, formula (MiB) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = f"{r['measured'] / one:.4f} (1/cp = {1 / r['cp']:.4f})" if one else "—"
        lines.append(f"| {r['cp']} | {r['rank']} | {_mib(r['measured'])} | {_mib(r['formula'])} | "
                     f"{r['measured'] / r['formula']:.4f} | {share} | {(r['measured'] - r['formula']) / r['layers']:,.0f} | "
                     f"{_mib(r['outside'])} | {_mib(r['ring_buffers'])} |")
    lines += ["", ("| cp | rank | sent per layer, forward: measured (bytes) | formula | sends | backward: measured "
                   "(bytes) | formula | sends |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cp']} | {r['rank']} | {r['sent_forward']:,.0f} | {r['ring_forward']:,.0f} | "
                     f"{r['sends_forward']:g} | {r['sent_backward']:,.0f} | {r['ring_backward']:,.0f} | "
                     f"{r['sends_backward']:g} |")
    lines += ["", ("| cp | rank | RSS before forward (MiB) | peak RSS (MiB) | peak − before (MiB) | one score block "
                   "b·a·(s/cp)²·4 (MiB) | forward + backward (s) | loss |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cp']} | {r['rank']} | {_mib(r['rss_before'])} | {_mib(r['peak_rss'])} | "
                     f"{_mib(r['peak_rss'] - r['rss_before'])} | {_mib(r['score_block'])} | {r['seconds']:.1f} | "
                     f"{r['loss']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.cp, args.layers, args.hidden, args.heads, args.kv_heads, args.vocab = 64, [2], 1, 32, 2, 1, 64
    print(f"Llama-style: {args.layers} layers, hidden {args.hidden}, {args.heads} query / {args.kv_heads} KV heads, "
          f"vocab {args.vocab}; seq {args.seq}, micro-batch {args.batch}; fp32, CPU, gloo, one thread a rank")
    rows = []
    for cp in args.cp:
        rows += run_world(cp, _world_fn, args, timeout_s=1800)
        print(f"cp {cp} done", flush=True)
    print(table(rows))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
