"""`infer/openmp.py`: the calling thread's OpenMP workers are handed back, and parallel work still runs after.

Counted in /proc/self/task (Linux: the wheels' GNU OpenMP), in a fresh interpreter so that no other test's
threads are counted, with two torch threads (one worker beside the calling thread)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import os, torch
    from meshlm.infer import openmp
    torch.set_num_threads(2)
    def threads():
        return len(os.listdir("/proc/self/task"))
    x = torch.arange(4_000_000, dtype=torch.float64)
    openmp.release_pool()  # whatever set-up ran in parallel (the arange) hands its workers back first
    before = threads()
    total = (x * 2).sum().item()  # large enough for a parallel region: the pool's worker starts
    with_pool = threads()
    released = openmp.release_pool()
    after = threads()
    again = (x * 2).sum().item()  # a new pool for the next region, the same result
    print(before, with_pool, released, after, threads(), total == again)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_release_pool_hands_back_the_workers_and_parallel_work_goes_on():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=root, check=True,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}).stdout.split()
    before, with_pool, released, after, rebuilt, same = out
    assert released == "True"
    assert int(with_pool) == int(before) + 1  # one worker beside the calling thread
    assert int(after) == int(before)  # handed back
    assert int(rebuilt) == int(with_pool)  # the next region started a pool again
    assert same == "True"
