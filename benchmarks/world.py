"""Spawn a gloo world of CPU processes for a benchmark and return rank 0's result, with a deadline."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init: str, fn, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(args, world)
        if rank == 0:
            queue.put(result)
        dist.barrier()  # every rank's last collective done before any tears gloo down (else one can abort)
    finally:
        dist.destroy_process_group()


def run_world(world: int, fn, args, timeout_s: float = 300):
    """`fn(args, world)` on each of `world` processes (a module-level function); rank 0's return value."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, world, init, fn, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            return queue.get(timeout=timeout_s)  # a deadline: a hung world fails instead of blocking
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
