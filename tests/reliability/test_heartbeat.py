"""A stopped peer is reported by rank, host and pid within `parallel.heartbeat_s`, with the reporting
process's thread stacks and exit code 3; a rank that finished first is not taken for a dead one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch.distributed as dist

from meshlm.parallel.heartbeat import EXIT_CODE, Heartbeat

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from meshlm.parallel.heartbeat import Heartbeat
    rank, world, init, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    hb = Heartbeat(dist.distributed_c10d._get_default_store(), rank, world, timeout_s=2.0).start()
    print("ready", flush=True)
    if mode == "stop" and rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its heartbeat thread stops with it
    if mode == "finish" and rank == 1:
        hb.stop()  # done early: its watcher must not report it
        time.sleep(8)
        sys.exit(0)
    time.sleep(8)  # "working" (longer than the 2 s heartbeat timeout)
    hb.stop()
    print("finished", flush=True)
""")


def _world(tmp_path: Path, mode: str, n: int = 3) -> list[subprocess.Popen]:
    init = f"file://{tmp_path}/rendezvous"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(n), init, mode], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env) for r in range(n)]


def test_a_sigstopped_peer_is_reported_within_the_heartbeat_timeout(tmp_path):
    procs = _world(tmp_path, "stop")
    start = time.monotonic()
    try:
        code = procs[0].wait(timeout=60)  # rank 0 watches rank 1
        elapsed = time.monotonic() - start
        err = procs[0].stderr.read()
    finally:
        for p in procs:
            p.kill()
    assert code == EXIT_CODE, err
    assert "error: rank 1 (host " in err and "has sent no heartbeat for" in err, err
    assert "Thread 0x" in err or "Current thread" in err, "every thread's stack of the reporter"
    assert elapsed < 20, f"reported after {elapsed:.0f} s (start-up included), timeout 2 s"


def test_a_rank_that_finished_first_is_not_reported(tmp_path):
    procs = _world(tmp_path, "finish")
    try:
        codes = [p.wait(timeout=60) for p in procs]
        errs = [p.stderr.read() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0, 0], errs
    assert not any("heartbeat" in e for e in errs), errs


class _Store:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_the_watcher_measures_silence_on_its_own_clock():
    store, seen = _Store(), []
    alive = Heartbeat(store, 1, 2, timeout_s=0.4).start()  # rank 1 beats
    watcher = Heartbeat(store, 0, 2, timeout_s=0.4, on_dead=lambda *a: seen.append(a[0])).start()
    time.sleep(1.0)
    assert seen == [], "a beating peer is alive"
    alive._stop.set()  # stops beating without saying done: as a frozen process
    time.sleep(1.5)
    watcher.stop()
    assert seen == [1]


def test_no_heartbeat_for_one_process():
    from meshlm.parallel.heartbeat import start_heartbeat
    from meshlm.parallel.mesh import ParallelDims

    assert not dist.is_initialized()
    assert start_heartbeat(ParallelDims(), 120) is None
