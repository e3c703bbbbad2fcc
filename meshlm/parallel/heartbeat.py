"""A heartbeat between ranks: a stopped or frozen peer is reported by rank and host within
`parallel.heartbeat_s`, instead of the others waiting out a collective's whole timeout.

Each rank runs a daemon thread that, every heartbeat_s / 8 seconds, bumps a counter under its own key in
the process group's store (torchrun's TCPStore, or the file store of a test) and reads the key of the
rank it watches, its successor on a ring (rank r watches r + 1 mod world). Times are measured on the
watcher's own monotonic clock from the last change it saw, so clocks of different hosts never matter,
and each rank reads one key, so the store's load grows with the world size, not its square.

A process stopped by SIGSTOP, frozen by a dying machine, or killed outright stops beating. When the
watched rank has not changed its counter for heartbeat_s, the watcher prints one line naming that rank,
its host and pid, then every thread's stack of its own process (what it was waiting on), and exits with
code 3, so torchrun stops the job. A rank whose main thread is stuck while its process lives (a
deadlock, a collective waiting on a dead peer) still beats: collectives' own timeout
(`parallel.timeout_s`) covers that case.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time

EXIT_CODE = 3
PREFIX = "meshlm/heartbeat"


class Heartbeat:
    """Start with `start()` after the process group exists; `stop()` before tearing it down."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, on_dead=None):
        self.store, self.rank, self.world = store, rank, world_size
        self.timeout_s, self.interval = timeout_s, max(0.05, timeout_s / 8)
        self.watched = (rank + 1) % world_size
        self.on_dead = on_dead or _report_and_exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshlm-heartbeat", daemon=True)
        self._beats = 0

    def start(self) -> Heartbeat:
        self._beat()  # the first beat before anyone starts watching
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and say so: a watcher that reads `done` stops watching (a rank that finished
        first is not a dead one)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)
        with contextlib.suppress(Exception):  # the store may already be gone
            self.store.set(f"{PREFIX}/{self.rank}", f"done {socket.gethostname()} {os.getpid()}")

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{PREFIX}/{self.rank}", f"{self._beats} {socket.gethostname()} {os.getpid()}")

    def _read_watched(self) -> str | None:
        key = f"{PREFIX}/{self.watched}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 (a store that went away: the collectives will report it)
            return None

    def _run(self) -> None:
        last_value, last_change, watching = None, time.monotonic(), True
        while not self._stop.wait(self.interval):
            try:
                self._beat()  # beating goes on until stop(), whatever the watched rank does
            except Exception:  # noqa: BLE001 (the store is gone: the job is ending)
                return
            if not watching:
                continue
            value = self._read_watched()
            now = time.monotonic()
            if value is not None and value.startswith("done"):
                watching = False  # the watched rank finished its work
            elif value is None or value != last_value:  # news, or a store we cannot read (the job is ending)
                last_value, last_change = value or last_value, now
            elif now - last_change > self.timeout_s and not self._stop.is_set():
                host, pid = (last_value.split()[1:3] if last_value else ("?", "?"))
                self.on_dead(self.watched, host, pid, now - last_change, self)
                return


def _report_and_exit(rank: int, host: str, pid: str, silent_s: float, hb: Heartbeat) -> None:
    print(f"error: rank {rank} (host {host}, pid {pid}) has sent no heartbeat for {silent_s:.0f} s "
          f"(parallel.heartbeat_s={hb.timeout_s:g}): it is stopped, frozen or gone; rank {hb.rank} stops the "
          "job. This process's threads were:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def start_heartbeat(dims, timeout_s: float) -> Heartbeat | None:
    """A running heartbeat for this process's world (None for one process, or with timeout_s = 0)."""
    import torch.distributed as dist

    if timeout_s <= 0 or dims.world_size == 1 or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    return Heartbeat(store, dims.rank, dims.world_size, timeout_s).start()
