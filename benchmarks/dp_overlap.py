"""Data parallelism on CPU (gloo, dp = 2): the gradient reduction overlapped with backward, or not.

Each of 2 processes trains the same GPT on its own micro-batches (`meshlm.parallel.data`), timed per step:

* compute only: the same steps, buckets and buffers with every collective skipped (the lower bound);
* overlap off: every bucket is all-reduced after the backward (`BucketedDataParallel(overlap=False)`);
* overlap on: each bucket is all-reduced as soon as the step's last backward has produced it (the default);
* ZeRO-2: buckets reduce-scattered during backward, parameter shards all-gathered after the step.

Exposed communication = step time − compute-only step time (what the reduction adds to the step); "wait"
is the time spent in `finish()` waiting for reductions after the backward returned.

Bytes: "handed to collectives" is the flat gradient (and, for ZeRO, parameter) buffers passed to gloo per
step; "sent" is measured: the bytes this process wrote to its sockets (`wchar` of /proc/self/io; nothing
else is written during a step). Theory for a ring all-reduce of N bytes over d ranks: 2·(d−1)/d·N sent per
rank (= N at d = 2); a reduce-scatter or all-gather: (d−1)/d·N.

    .venv/bin/python benchmarks/dp_overlap.py [--layers 8 --hidden 256 --vocab 2048 --seq 128 --micro-batch 4]
    .venv/bin/python benchmarks/dp_overlap.py --smoke      # a 1-layer model, one timed step
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script
from world import run_world  # benchmarks/world.py, beside this script

from meshlm.core.config import build
from meshlm.models.gpt import GPT
from meshlm.models.loss import cross_entropy
from meshlm.parallel.buckets import BucketedDataParallel
from meshlm.parallel.mesh import ParallelDims
from meshlm.train.optim import build_optimizer

MODES = ("compute only", "overlap off", "overlap on", "ZeRO-2 (overlap on)")


def _wchar() -> int:
    with open("/proc/self/io") as fh:
        fields = dict(line.split(": ") for line in fh.read().splitlines())
    return int(fields["wchar"])


class _Done:
    def wait(self) -> None:
        pass


class _NoReduction(BucketedDataParallel):
    """The same buckets, hooks and buffers, with every collective skipped: the compute-only baseline."""

    def _launch(self, b) -> None:
        b.work = _Done()
        self._next += 1


def _make(cfg, dims: ParallelDims, mode: str, accum: int):
    torch.manual_seed(0)
    model = GPT(cfg.model)
    kind = _NoReduction if mode == "compute only" else BucketedDataParallel
    sync = kind(model, dims, accum, zero=2 if mode.startswith("ZeRO") else 0, bucket_mb=cfg.parallel.bucket_mb,
                overlap=mode != "overlap off")
    return model, sync, build_optimizer(sync, cfg.optim)


def _step(model, sync, opt, batches, accum: int) -> tuple[float, float]:
    """(step seconds, seconds waiting in finish())."""
    start = time.perf_counter()
    for x, y in batches:
        (cross_entropy(model(x), y) / accum).backward()
    wait = time.perf_counter()
    sync.finish()
    wait = time.perf_counter() - wait
    opt.step()
    sync.after_step()
    sync.zero_grad(opt)
    return time.perf_counter() - start, wait


def _measure(args, world: int) -> dict:
    """One rank's timings and bytes for every mode (run_world returns rank 0's)."""
    torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    cfg = build({"model": {"n_layers": args.layers, "hidden_size": args.hidden, "n_heads": args.hidden // 64,
                           "seq_len": args.seq, "vocab_size": args.vocab},
                 "parallel": {"dp": 2, "bucket_mb": args.bucket_mb}})
    dims = ParallelDims.build(dp=2, timeout_s=300)
    g = torch.Generator().manual_seed(rank)
    batches = [(x[:, :-1], x[:, 1:]) for x in
               (torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g) for _ in range(args.accum))]
    runs = {mode: _make(cfg, dims, mode, args.accum) for mode in MODES}
    times = {mode: [] for mode in MODES}
    sent = {mode: [] for mode in MODES}
    for rep in range(args.warmup + args.steps):
        for mode in MODES:  # interleaved, so background load hits every mode alike
            dist.barrier()
            before = _wchar()
            step_s, wait_s = _step(*runs[mode], batches, args.accum)
            after = _wchar()
            if rep >= args.warmup:
                times[mode].append((step_s, wait_s))
                sent[mode].append(after - before)
    handed = {}
    for mode, (_, sync, _) in runs.items():
        grad_bytes = 0 if mode == "compute only" else sum(b.numel for b in sync.buckets) * 4
        handed[mode] = grad_bytes * (2 if mode.startswith("ZeRO") else 1)  # + the parameter all-gather
    n_params = sum(p.numel() for p in runs["overlap on"][0].parameters())
    n_buckets = len(runs["overlap on"][1].buckets)
    return {"times": times, "sent": sent, "handed": handed, "n_params": n_params, "n_buckets": n_buckets}


def report(res: dict, args) -> str:
    med = {m: statistics.median(s for s, _ in res["times"][m]) for m in MODES}
    wait = {m: statistics.median(w for _, w in res["times"][m]) for m in MODES}
    n_bytes = res["n_params"] * 4
    ring_ar = n_bytes  # 2·(d−1)/d·N at d = 2
    theory = {"compute only": 0, "overlap off": ring_ar, "overlap on": ring_ar,
              "ZeRO-2 (overlap on)": n_bytes // 2 + n_bytes // 2}  # reduce-scatter + all-gather, (d−1)/d·N each
    head = (f"GPT {args.layers} layers, h={args.hidden}, vocab {args.vocab}, seq {args.seq}: "
            f"{res['n_params']:,} parameters ({n_bytes / 1e6:.1f} MB of fp32 gradients) in {res['n_buckets']} "
            f"buckets of about {args.bucket_mb} MiB; {args.accum} micro-batches of {args.micro_batch} per rank and "
            f"step; dp = 2, gloo, {args.threads} thread(s) per process; median of {args.steps} steps")
    columns = ("| mode | step time | exposed communication | wait after backward | handed to collectives per rank "
               "| sent per rank (measured) | ring theory |")
    lines = [head, "", columns, "|---|---|---|---|---|---|---|"]
    for m in MODES:
        exposed = med[m] - med["compute only"]
        lines.append(f"| {m} | {1e3 * med[m]:.1f} ms | {1e3 * exposed:+.1f} ms | {1e3 * wait[m]:.1f} ms | "
                     f"{res['handed'][m] / 1e6:.2f} MB | {statistics.median(res['sent'][m]) / 1e6:.2f} MB | "
                     f"{theory[m] / 1e6:.2f} MB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.vocab, args.seq, args.micro_batch, args.steps, args.warmup = 1, 64, 128, 16, 1, 1, 0
        args.bucket_mb = 0.01
    print(report(run_world(2, _measure, args, timeout_s=600), args))


if __name__ == "__main__":
    main()
