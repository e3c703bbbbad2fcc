"""Start a gloo world of processes for a test, with a deadline so a hang fails instead of blocking.

`run_world(fn, n, tmp_path)` starts n processes that each call `fn(rank, n, out_dir)` after joining the
default process group (file rendezvous: no ports); each rank's return value comes back in a list.

The processes are forked from the test process, not spawned: a spawned rank spends 3-5 s of CPU importing
torch and meshlm's parallel stack again, and n of them share this machine's 2 cores (a world of 8 took
~20 s to start). The torch and distributed modules the ranks use are imported here once, before the fork;
each rank then starts as a fresh interpreter would for what the tests can see: one intra-op thread,
float32 default dtype, gradients on, torch's default seed. The test process itself never joins a process
group (meshlm initialises one only for a world > 1), so a forked rank starts without one. A test process
that has initialised CUDA cannot fork ranks that use it: there, the ranks are spawned as before.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # imported before the fork, as the ones below: see the module docstring
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor.parallel
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
FRESH_SEED = 67280421310721  # torch.initial_seed() of a fresh interpreter


def _entry(rank: int, fn, world_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # n processes on a 2-core machine
    torch.set_default_dtype(torch.float32)  # what a fresh interpreter has, whatever the test process had
    torch.set_grad_enabled(True)
    torch.manual_seed(FRESH_SEED)
    if dist.is_initialized():
        raise RuntimeError("run_world forks the test process, which must not hold a process group")
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = fn(rank, world_size, out_dir)
        torch.save(result, Path(out_dir) / f"result_{rank}.pt")
        # No rank tears gloo down while another still talks to it: that aborted a rank about one world in
        # a few hundred ("terminate called without an active exception", SIGABRT), as in benchmarks/world.py.
        dist.barrier()
    except BaseException:
        (Path(out_dir) / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_world(fn, world_size: int, out_dir: str | Path, deadline_s: float = 180) -> list:
    """Run `fn(rank, world_size, out_dir)` on `world_size` forked processes; returns their results."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(fn, world_size, str(out_dir)), nprocs=world_size, join=False,
                             start_method="spawn" if torch.cuda.is_initialized() else "fork")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of {world_size} did not finish within {deadline_s:.0f}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out_dir / f"result_{r}.pt", weights_only=False) for r in range(world_size)]
