"""Training runs to kill -9, forked from a clean process: multiprocessing's fork server, where torch and the
trainer are imported once, so a run starts in well under a second, as it did when the tests forked themselves.

A test no longer forks its own process: a pytest worker that has run other tests before holds their threads
(engines, thread pools, Inductor's compile workers), and a child forked while one of them held a lock waits on
it forever (after fork, POSIX allows a threaded process's child only async-signal-safe calls). CI once saw
exactly that: children that never reached their first step, two tests past their 20 minutes. The fork server
has one thread. A run that is late anyway can say where it is: `Run.stack()` (faulthandler, every thread)."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import time
from pathlib import Path

_CTX = multiprocessing.get_context("forkserver")
# torch._dynamo: what an optimizer's first construction imports (1.9 of a run's 2 s of set-up)
_CTX.set_forkserver_preload(["torch", "torch._dynamo", "meshlm.train.trainer"])


def _train(config, env: dict[str, str], stack_file: str, stall_write: str | None) -> None:
    """The child: the test's environment (the fork server keeps the one it started with), one intra-op thread,
    stacks on SIGUSR1, then the run. `stall_write`: a background write of a file whose temporary name holds
    this text never ends (test_rel_async.py kills the run while it hangs)."""
    os.environ.clear()
    os.environ.update(env)
    import torch

    from meshlm.checkpoint import files
    from meshlm.train.trainer import Trainer

    torch.set_num_threads(1)
    stacks = open(stack_file, "w")  # noqa: SIM115 (open until the process dies: faulthandler writes to it)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if stall_write is not None:
        real = files._ChecksumWriter._disk_write

        def write(self, view):
            if stall_write in self.fh.name:
                Path(stack_file).with_suffix(".stalled").touch()
                time.sleep(3600)
            return real(self, view)

        files._ChecksumWriter._disk_write = write
    Trainer(config).run()


class Run:
    """`Trainer(config).run()` in a process of the fork server, started at once."""

    def __init__(self, config, scratch: Path, stall_write: str | None = None):
        scratch.mkdir(parents=True, exist_ok=True)
        self.stack_file = scratch / f"stacks-{time.monotonic_ns()}.txt"
        self.stalled = self.stack_file.with_suffix(".stalled")  # touched when the stalled write starts
        self.proc = _CTX.Process(target=_train, args=(config, dict(os.environ), str(self.stack_file), stall_write),
                                 daemon=True)
        self.proc.start()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """SIGKILL, then reaped."""
        self.proc.kill()
        self.proc.join()

    def stack(self, wait_s: float = 5.0) -> str:
        """Every thread's stack, as the run prints it on SIGUSR1 (empty if it could not)."""
        if not self.proc.is_alive():
            return ""
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            text = self.stack_file.read_text() if self.stack_file.exists() else ""
            if "Current thread" in text or "Thread 0x" in text:
                time.sleep(0.2)  # the rest of the threads
                return self.stack_file.read_text()
            time.sleep(0.05)
        return ""
