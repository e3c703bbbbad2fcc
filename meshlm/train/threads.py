"""Threads on a shared CPU (`train.adapt_threads`): fewer torch threads while other processes hold cores, every
thread again when they leave.

A CPU training step runs each operation on all of torch's OpenMP threads (one per core) and waits for the slowest.
When another process keeps a core busy, the thread the scheduler put aside holds back all the others, which spin
while they wait: beside one busy process a step of `make demo` on 2 cores took 2.8-3.1× as long, where the other
process's fair share of the CPU explains 2×. With one thread fewer the step does not wait on a core it does not
get. Alone, torch's default (spinning threads, one per core) is the fastest, so nothing changes on a quiet machine.

`ThreadGovernor` measures, over windows of `window_s` seconds, how much CPU the other processes used: the machine's
busy time from /proc/stat (user, nice, system, irq, softirq; idle, I/O wait and the hypervisor's steal are not
another process's) minus this process's own CPU time. It sets torch's thread count to the share of the CPUs left
(`threads_for`), once two windows in a row agree (a command that runs for a moment does not move it). Linux only
(/proc/stat); elsewhere, and where the user chose (OMP_NUM_THREADS, `train.adapt_threads = false`), it is off.
docs/threads.md has the measurements (benchmarks/busy_step.py).

The thread count changes the order of torch's parallel reductions, so the same step computed with another count
can differ in the last bits. A checkpoint therefore holds the count and the governor's changes (`state_dict`),
and a resumed run starts with the count its checkpoint's step had (`load_state_dict`), not torch's default: a run
killed and resumed on a host as busy as before continues bit for bit. The governor still follows the load after
that, so a resumed run is bit-equal to the uninterrupted one when both used the same count at every later step
(docs/reliability.md says exactly when); `train.deterministic` turns the governor off and keeps the count.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

WINDOW_S = 2.0  # seconds of CPU accounting per decision (the clock ticks at 100 Hz: 1% resolution)


def cpu_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (every CPU added up), from /proc/stat; None where
    it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 8 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_for(most: int, cpus: int, others: float) -> int:
    """Torch threads when the other processes use `others` CPUs of `cpus`: `most` (torch's own choice) scaled by
    the share left, rounded, at least 1. On 2 CPUs with one other busy process: 1."""
    left = max(0.0, cpus - others) / cpus
    return max(1, min(most, math.floor(most * left + 0.5)))


class ThreadGovernor:
    """Call `after_step()` after every training step; it returns a line to log when it changes the thread count."""

    def __init__(self, most: int, cpus: int, *, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[], float | None] = cpu_busy_seconds, own: Callable[[], float] = time.process_time,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.most, self.cpus, self.window_s = most, cpus, window_s
        self.clock, self.busy, self.own, self.set_threads = clock, busy, own, set_threads
        self.threads = most
        self.others = 0.0  # the other processes' CPUs in the last window
        self.pending = most  # the last window's choice, applied when the next one agrees
        self.mark = (clock(), busy(), own())
        self.history: list[list[int]] = [[0, most]]  # [steps done, the count used from the next step on], per change

    def state_dict(self) -> dict:
        """The count in use and every change so far, for a checkpoint."""
        return {"threads": self.threads, "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> str | None:
        """Continue a checkpoint's run: its thread count (set now) and its history; a line to log if the count
        differs from this process's."""
        saved = int(state["threads"])
        self.history = [list(h) for h in state.get("history", [])] or [[0, saved]]
        if saved == self.threads:
            return None
        before, self.threads, self.pending = self.threads, saved, saved
        self.set_threads(saved)
        return f"threads: torch threads {before} → {saved}, the count the resumed run had at its checkpoint " \
               "(so its steps repeat bit for bit; train.adapt_threads, docs/reliability.md)"

    def after_step(self, step: int | None = None) -> str | None:
        """`step`: the steps done (recorded with a change, whose count applies from the next step)."""
        now, busy, own = self.clock(), self.busy(), self.own()
        t0, busy0, own0 = self.mark
        if now - t0 < self.window_s or busy is None or busy0 is None:
            return None
        self.mark = (now, busy, own)
        self.others = max(0.0, ((busy - busy0) - (own - own0)) / (now - t0))
        choice = threads_for(self.most, self.cpus, self.others)
        agreed, self.pending = choice == self.pending, choice
        if not agreed or choice == self.threads:
            return None
        before, self.threads = self.threads, choice
        self.set_threads(choice)
        if step is not None:
            self.history.append([step, choice])
        why = (f"other processes use {self.others:.1f} of {self.cpus} CPUs" if choice < self.most
               else f"the CPUs are free again (other processes use {self.others:.1f} of {self.cpus})")
        return f"threads: {why}; torch threads {before} → {choice} (train.adapt_threads, docs/threads.md)"


def thread_governor(enabled: bool, device: torch.device) -> ThreadGovernor | None:
    """The governor for a CPU run that may adapt: `train.adapt_threads` on, no OMP_NUM_THREADS chosen by the user
    (torchrun sets it to 1 for several processes per node), more than one thread to give, /proc/stat readable."""
    if not enabled or device.type != "cpu" or "OMP_NUM_THREADS" in os.environ or cpu_busy_seconds() is None:
        return None
    most = torch.get_num_threads()
    return ThreadGovernor(most, usable_cpus()) if most > 1 else None


def thread_state(governor: ThreadGovernor | None) -> dict:
    """What a checkpoint records of the threads: the governor's state, or the count this process runs with."""
    return governor.state_dict() if governor is not None else {"threads": torch.get_num_threads(), "history": []}


def restore_threads(governor: ThreadGovernor | None, saved: dict | None, pinned: bool) -> str | None:
    """A resumed run's thread count: the checkpoint's (`saved`, from `thread_state`) through the governor, or set
    directly when the count is `pinned` (train.deterministic); left alone otherwise (the user chose it, e.g.
    OMP_NUM_THREADS or train.adapt_threads=false), or when the checkpoint predates the record. A line to log."""
    if not saved:
        return None
    if governor is not None:
        return governor.load_state_dict(saved)
    count, now = int(saved["threads"]), torch.get_num_threads()
    if not pinned or count == now:
        return None
    torch.set_num_threads(count)
    return f"threads: torch threads {now} → {count}, the count the resumed run had (train.deterministic pins it)"
