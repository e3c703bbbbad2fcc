"""Straggler reports: every `train.straggler_every` steps the ranks compare how long their own steps took and
rank 0 names the ones that are slower than their peers by more than `train.straggler_ratio` (docs/cluster.md).

Why not the step time: the collectives of a step (the gradient reduction, the loss average, the gradient
norm, the stop flag) make every rank's step last as long as the slowest rank's, so the total says nothing
about who is slow. Each step is cut into three phases instead:

- compute: from the step's start until the last micro-batch's backward returns (forward, loss and backward;
  the dp buckets' reductions are only *launched* in there, asynchronously, `parallel/buckets.py`). Under
  pipeline parallelism the schedule's point-to-point waits are in there too (they cannot be told apart), so
  ranks are compared only with the ranks of their own pipeline stage.
- wait: from there until the step's loss and gradient norm reach the host (`sync.finish()` blocked on the
  reductions, the loss average, the gradient norm's and the stop flag's all-reduces, and the clipping).
- rest: the optimizer step, ZeRO's parameter all-gather and the gradients' reset.

A slow rank shows a large compute time and a small wait; its peers the opposite (they wait for it). The
report compares each rank's mean compute time over the window with the lower median of its stage's
(the lower of the two middle values, so that with two ranks the ratio is slow/fast, not slow/mean).

Timing costs nothing measurable: on a CPU four `time.perf_counter()` calls a step; on CUDA four events
recorded on the current stream, read once they have completed (`Event.query()`, no wait), and one
`torch.cuda.synchronize()` when a report is due. The report itself is one all-gather of four numbers per
rank over the world group (every rank calls it at the same step), and the hosts' names once, at the first.
"""

from __future__ import annotations

import itertools
import socket
import statistics
import time

import torch
import torch.distributed as dist

PHASES = ("compute_s", "wait_s", "rest_s")
MAX_NAMED = 4  # ranks named in the log line (the metrics record keeps every one over the threshold)


class StepTimer:
    """The phase marks of each step (`mark()` at its start and after each phase) and their sums over the
    report's window. CPU: wall-clock seconds; CUDA: the current stream's elapsed time between events."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.sums = [0.0] * len(PHASES)
        self.steps = 0
        self._marks: list = []
        self._pending: list[list] = []  # CUDA: steps whose events may not have completed yet

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def end_step(self) -> None:
        marks, self._marks = self._marks, []
        if len(marks) != len(PHASES) + 1:  # a step that did not pass every mark (an exception): not counted
            return
        if not self.cuda:
            self._add([b - a for a, b in itertools.pairwise(marks)])
            return
        self._pending.append(marks)
        while self._pending and self._pending[0][-1].query():  # completed: read without waiting
            self._add_events(self._pending.pop(0))

    def take(self) -> tuple[list[float], int]:
        """The window's summed phase seconds and step count; the window starts again."""
        if self._pending:  # the report is due: wait for this rank's last steps once
            torch.cuda.synchronize()
            for marks in self._pending:
                self._add_events(marks)
            self._pending = []
        sums, steps = self.sums, self.steps
        self.sums, self.steps = [0.0] * len(PHASES), 0
        return sums, steps

    def _add_events(self, marks: list) -> None:
        self._add([a.elapsed_time(b) / 1000.0 for a, b in itertools.pairwise(marks)])

    def _add(self, seconds: list[float]) -> None:
        self.sums = [s + x for s, x in zip(self.sums, seconds)]
        self.steps += 1


class StragglerWatch:
    """Times every step (`timer`) and, every `every` steps, gathers the ranks' means and finds the slow ones.

    `report(step)` must be called by every rank after every step; it returns rank 0's metrics record when a
    rank passed the threshold (None otherwise, and always None on the other ranks)."""

    def __init__(self, every: int, ratio: float, rank: int, world_size: int, stage_size: int, device: torch.device):
        self.every, self.ratio = every, ratio
        self.rank, self.world, self.stage_size = rank, world_size, stage_size
        self.device = device
        self.timer = StepTimer(device)
        self.hosts: list[str] | None = None

    def mark(self) -> None:
        self.timer.mark()

    def end_step(self) -> None:
        self.timer.end_step()

    def report(self, step: int) -> dict | None:
        if step % self.every != 0:
            return None
        sums, steps = self.timer.take()
        mine = torch.tensor([*sums, float(steps)], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        if self.hosts is None:
            self.hosts = [""] * self.world
            dist.all_gather_object(self.hosts, socket.gethostname())
        if self.rank != 0:
            return None
        means = [[v / max(1.0, float(row[-1])) for v in row[:-1].tolist()] for row in rows]
        return find_stragglers(means, self.hosts, self.stage_size, self.ratio, step, int(rows[0][-1]))


def find_stragglers(means: list[list[float]], hosts: list[str], stage_size: int, ratio: float, step: int,
                    steps: int) -> dict | None:
    """The metrics record naming every rank whose mean compute time is over `ratio` × the lower median of its
    pipeline stage's ranks (`stage_size` consecutive ranks share a stage), slowest first; None when none is."""
    slow = []
    for rank, (compute, wait, rest) in enumerate(means):
        stage = rank // stage_size
        peers = [m[0] for m in means[stage * stage_size:(stage + 1) * stage_size]]
        median = statistics.median_low(peers)
        if len(peers) > 1 and median > 0 and compute / median > ratio:
            slow.append({"rank": rank, "host": hosts[rank], "ratio": compute / median, "compute_s": compute,
                         "median_compute_s": median, "wait_s": wait, "rest_s": rest})
    if not slow:
        return None
    slow.sort(key=lambda s: -s["ratio"])
    waits = statistics.median_low([m[1] for m in means])
    return {"kind": "stragglers", "step": step, "window_steps": steps, "threshold": ratio,
            "median_wait_s": waits, "slow": slow}


def straggler_line(rec: dict) -> str:
    """The log line of a straggler record."""
    named = [f"rank {s['rank']} ({s['host']}) {s['ratio']:.1f}x: {s['compute_s']:.3f} s vs {s['median_compute_s']:.3f} s"
             for s in rec["slow"][:MAX_NAMED]]
    more = len(rec["slow"]) - MAX_NAMED
    extra = f" and {more} more (metrics.jsonl)" if more > 0 else ""
    return (f"stragglers at step {rec['step']} (mean compute per step over the last {rec['window_steps']} steps, "
            f"against the median of the stage's ranks; over train.straggler_ratio={rec['threshold']:g}): "
            + "; ".join(named) + extra + f"; ranks wait a median {rec['median_wait_s']:.3f} s per step in collectives")


class NoWatch:
    """Off (`train.straggler_every=0`) or one process (nothing to compare): times nothing, reports nothing."""

    def mark(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def report(self, step: int) -> None:
        return None


def straggler_watch(every: int, ratio: float, dims) -> StragglerWatch | NoWatch:
    """The run's watch (`dims`: its `ParallelDims`)."""
    if every <= 0 or dims.world_size == 1:
        return NoWatch()
    return StragglerWatch(every, ratio, dims.rank, dims.world_size, dims.world_size // dims.pp, dims.device)
