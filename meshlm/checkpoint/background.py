"""Checkpoints written in the background (`train.async_save`): copied at the step, written while training goes on.

At a checkpoint step the training thread copies the state off the training tensors (`HostCopier`: into
host buffers, pinned on CUDA, reused from one save to the next) and hands the copy to `BackgroundWriter`,
whose one worker thread writes the files while the next steps run. The files, their checksums, the
manifest written last and the atomic rename are those of a synchronous save (`files.py`), so a kill at any
moment leaves the previous checkpoint valid and a `.tmp-step_*` directory that the next run prunes.

Who publishes: one process (`SingleJob`) has no collective, so the worker runs the whole
`single.save_checkpoint`, publish included. Several processes (`sharded.PendingSave`) split the save: the
worker only writes this rank's files; agreeing that every rank wrote its part (an all-reduce), gathering the
pieces' index and rank 0's publish (a gather and a barrier) are collectives, which must not run in a second
thread beside the training step's collectives on the same process group (gloo and NCCL order a group's
operations by the order of the calls, which two threads would make differ between ranks). So the training
thread completes the save at a step boundary: `done_everywhere` (one all-reduce of "my worker is done" per
step while a save is in flight) and, once every rank is done, the job's `finish`. One save at a time: the
next one first waits for the one in flight (`wait`).

Errors are kept by the job and raised by `finish` on the training thread: the same `CheckpointWriteError`
or `TrainingError` lines as a synchronous save.
"""

from __future__ import annotations

import copy
import ctypes
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshlm.checkpoint.single import save_checkpoint


class HostCopier:
    """Copies (nested) state off the training tensors into host buffers kept for the next save.

    `copy` keeps the sharing between tensors (a tied embedding under two names stays one storage, views keep
    their offsets and strides), so `torch.save` writes the copy exactly as it would write the original.
    Tensors on a GPU go to pinned buffers with asynchronous copies; `fence` returns the event the writer
    waits on before reading them."""

    def __init__(self):
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._used: list[torch.Tensor] = []
        self._storages: dict[tuple, torch.Tensor] = {}
        self._cuda = False

    def _buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        free = self._free.get((nbytes, pinned))
        buf = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._used.append(buf)
        return buf

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` alone (contiguous)."""
        pinned = t.device.type == "cuda"
        self._cuda |= pinned
        out = self._buffer(t.numel() * t.element_size(), pinned).view(t.dtype).view(t.shape)
        return out.copy_(t.detach(), non_blocking=pinned)

    def _shared(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` over a copy of its whole storage (one copy per storage)."""
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), storage.nbytes())
        buf = self._storages.get(key)
        if buf is None:
            pinned = t.device.type == "cuda"
            self._cuda |= pinned
            buf = self._storages[key] = self._buffer(storage.nbytes(), pinned)
            if pinned:
                buf.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage), non_blocking=True)
            elif storage.nbytes():  # a plain memcpy: about twice as fast as a uint8 `copy_` here
                ctypes.memmove(buf.data_ptr(), storage.data_ptr(), storage.nbytes())
        out = torch.empty(0, dtype=t.dtype).set_(buf.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        return out.requires_grad_(t.requires_grad) if t.is_leaf and t.is_floating_point() else out

    def copy(self, obj: Any) -> Any:
        """`obj` with every tensor copied to host memory and everything else deep-copied; objects shared
        within `obj` stay shared (so that pickle writes the copy byte for byte as the original)."""
        try:
            return self._copy(obj, {})
        finally:
            self._storages = {}

    def _copy(self, obj: Any, memo: dict) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        if isinstance(obj, torch.Tensor):
            out = self._shared(obj)
        elif isinstance(obj, dict):
            out = memo[id(obj)] = type(obj)()
            for k, v in obj.items():
                out[k] = self._copy(v, memo)
            if hasattr(obj, "__dict__"):  # a state dict's `_metadata`
                out.__dict__.update(copy.deepcopy(obj.__dict__, memo))
        elif type(obj) in (list, tuple):
            out = type(obj)(self._copy(v, memo) for v in obj)
        else:
            out = copy.deepcopy(obj, memo)
        memo[id(obj)] = out
        return out

    def fence(self) -> torch.cuda.Event | None:
        """An event recorded after the copies so far (None when none came from a GPU)."""
        if not self._cuda:
            return None
        self._cuda = False
        event = torch.cuda.Event()
        event.record()
        return event

    def release(self) -> None:
        """The buffers of the save just finished are free for the next one."""
        for buf in self._used:
            self._free.setdefault((buf.numel(), buf.is_pinned()), []).append(buf)
        self._used = []


@dataclass
class SingleJob:
    """A one-process checkpoint: the worker writes and publishes it (`single.save_checkpoint`, no collective)."""

    out_dir: Path
    step: int
    parts: dict
    config: dict
    path: Path | None = None
    error: BaseException | None = None

    def write(self) -> None:
        try:
            self.path = save_checkpoint(self.out_dir, self.step, self.parts, self.config)
        except Exception as err:  # noqa: BLE001 (raised again on the training thread by `finish`)
            self.error = err
        finally:
            self.parts = {}

    def finish(self) -> Path:
        if self.error is not None:
            raise self.error
        return self.path


@dataclass
class BackgroundWriter:
    """One worker thread; at most one checkpoint in flight (`job`). The training thread calls everything
    but the job's `write`."""

    copier: HostCopier = field(default_factory=HostCopier)
    job: Any = None  # a `SingleJob` or a `sharded.PendingSave`: write() in the worker, finish() -> Path here
    _future: Future | None = None
    _executor: ThreadPoolExecutor | None = None

    def submit(self, job) -> None:
        """Write `job` in the background (its tensors copied by `copier` just before)."""
        if self.job is not None:
            raise RuntimeError("a checkpoint is already being written; collect it first")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshlm-checkpoint")
        ready = self.copier.fence()
        self.job = job
        self._future = self._executor.submit(_write, job, ready)

    def done_everywhere(self, dims) -> bool:
        """Whether every rank's worker finished the job in flight (several processes: one small all-reduce,
        so that every rank completes it at the same step)."""
        if dims.world_size == 1:
            return self._future.done()
        done = torch.tensor([int(self._future.done())], dtype=torch.int32, device=dims.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def wait(self) -> float:
        """Block until this rank's worker finished the job in flight; the seconds waited."""
        began = time.perf_counter()
        self._future.result()
        return time.perf_counter() - began

    def collect(self) -> Path:
        """The finished job's `finish` (publish; several processes: a collective); raises its error."""
        job, self.job, self._future = self.job, None, None
        try:
            return job.finish()
        finally:
            self.copier.release()

    def close(self) -> None:
        """Let a write in flight end (never publishing it from here: no collective), stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.job, self._future = None, None


def _write(job, ready: torch.cuda.Event | None) -> None:
    if ready is not None:
        ready.synchronize()
    job.write()
