"""The pipeline bubble, measured: each stage's idle time per step against the theory (p − 1)/(v·m).

    python benchmarks/pipeline_bubble.py [--forward-ms 100] [--steps 3]
    python benchmarks/pipeline_bubble.py --smoke     # pp = 2 on 2 processes, t_f = 2 ms, one timed step

A world of 4 gloo processes runs meshlm's schedules (`meshlm.parallel.pipeline.build_schedule`: torch's
1F1B, interleaved 1F1B) over sleep-calibrated stages: on every pipeline rank a micro-batch's forward
sleeps `forward-ms` in total and its backward twice that (the usual t_b = 2·t_f), split evenly over the
rank's v virtual stages, so the ideal step (no bubble) takes m·(t_f + t_b) per rank whatever p, v and m
are. Sleeping instead of computing keeps 4 processes honest on a 2-core machine; what remains is the
schedule's waiting plus its communication.

Per rank: busy = the time spent inside the sleeps (measured), idle = step wall time (barrier to barrier)
− busy, bubble = idle / busy (the fraction of the ideal time lost). With pp = 2 the 4 processes form two
pipelines side by side. Theory (Narayanan et al. 2021): 1F1B (p − 1)/m, interleaved (p − 1)/(v·m); the
schedules' orders reach it exactly when messages and bookkeeping cost nothing (a dependency simulation
of the same orders gives the formula to 4 digits). What is left above it is the runtime's fixed cost per
compute action (send/recv, Python bookkeeping, process wake-up on a shared 2-core CPU): the
`overhead/action` column, which interleaving pays on 2·v·m actions per step instead of 2·m, the
trade-off the paper describes. `ok`: measured ≤ theory + 0.10 (10% of the ideal step time); the ratio
column shows the relative excess.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script
from torch import nn

CONFIGS = [(pp, vpp, m) for pp in (2, 4) for vpp in (1, 2) for m in (4, 8)]
SMOKE_CONFIGS = [(2, 1, 4), (2, 2, 4)]  # on a world of 2
WORLD = 4


class _Sleep(torch.autograd.Function):
    """Forward sleeps `fwd` seconds, backward `bwd`; both add the time actually slept to `clock[0]`."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, clock):
        ctx.bwd, ctx.clock = bwd, clock
        start = time.perf_counter()
        time.sleep(fwd)
        clock[0] += time.perf_counter() - start
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(ctx.bwd)
        ctx.clock[0] += time.perf_counter() - start
        return grad, None, None, None


class SleepStage(nn.Module):
    def __init__(self, fwd: float, bwd: float, clock: list):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.fwd, self.bwd, self.clock = fwd, bwd, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.fwd, self.bwd, self.clock)


def _measure(pp: int, vpp: int, m: int, forward_s: float, steps: int) -> dict:
    from torch.distributed.pipelining import PipelineStage

    from meshlm.parallel.mesh import ParallelDims
    from meshlm.parallel.pipeline import build_schedule

    dims = ParallelDims.build(pp=pp, timeout_s=120)
    clock = [0.0]
    fwd = forward_s / vpp  # a rank's work per micro-batch is split over its v chunks
    stage_ids = [dims.pp_rank + k * pp for k in range(vpp)]
    stages = [PipelineStage(SleepStage(fwd, 2 * fwd, clock), s, pp * vpp, torch.device("cpu"), group=dims.pp_group)
              for s in stage_ids]
    schedule = build_schedule(stages, m, lambda out, target: out.sum())
    x = torch.ones(m, 8)
    first, last = 0 in stage_ids, pp * vpp - 1 in stage_ids
    walls, busies = [], []
    for step in range(steps + 1):  # step 0 warms up (shape inference, connections)
        dist.barrier(group=dims.pp_group)
        clock[0] = 0.0
        start = time.perf_counter()
        schedule.step(*((x,) if first else ()), target=x if last else None)
        dist.barrier(group=dims.pp_group)  # the step ends when its last stage ends
        if step:
            walls.append(time.perf_counter() - start)
            busies.append(clock[0])
    idle = [w - b for w, b in zip(walls, busies)]
    return {"rank": dims.pp_rank, "wall": statistics.median(walls), "busy": statistics.median(busies),
            "idle": statistics.median(idle), "bubble": statistics.median(i / b for i, b in zip(idle, busies))}


def _worker(rank: int, out_dir: str, forward_s: float, steps: int, configs: list, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        results = {cfg: _measure(*cfg, forward_s, steps) for cfg in configs}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # every rank done talking before any tears gloo down (else one can abort)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forward-ms", type=float, default=100.0, help="a rank's forward time per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    configs, world = CONFIGS, WORLD
    if args.smoke:
        configs, world, args.forward_ms, args.steps = SMOKE_CONFIGS, 2, 2.0, 1
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(tmp, args.forward_ms / 1000, args.steps, configs, world), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 600
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise SystemExit("benchmark did not finish within 600 s")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    print(f"t_f = {args.forward_ms:g} ms, t_b = {2 * args.forward_ms:g} ms per micro-batch and rank; "
          f"median of {args.steps} steps; bubble = idle / busy per stage\n")
    print("| pp | vpp | m | theory (p−1)/(v·m) | measured (mean) | per stage | ideal step ms | step ms | "
          "measured / theory | overhead/action ms | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for pp, vpp, m in configs:
        runs = [r[(pp, vpp, m)] for r in ranks]  # with pp = 2: two pipelines, stages averaged over both
        bubbles = [statistics.mean(x["bubble"] for x in runs if x["rank"] == s) for s in range(pp)]
        theory = (pp - 1) / (vpp * m)
        mean = statistics.mean(bubbles)
        ideal = statistics.mean(x["busy"] for x in runs) * 1000
        wall = statistics.mean(x["wall"] for x in runs) * 1000
        ok = mean <= theory + 0.10
        per_action = (wall - ideal * (1 + theory)) / (2 * vpp * m)
        print(f"| {pp} | {vpp} | {m} | {theory:.3f} | {mean:.3f} | {' '.join(f'{b:.3f}' for b in bubbles)} | "
              f"{ideal:.0f} | {wall:.0f} | {mean / theory:.2f} | {per_action:.1f} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
