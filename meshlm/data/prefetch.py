"""Micro-batches built ahead on the host, in pinned memory, so the GPU never waits for the loader.

`PrefetchLoader` wraps a `BatchLoader`: a background thread builds the next `depth` micro-batches (numpy
reads and stacking, then `pin_memory()`), and `next()` hands the oldest one to the device with a
`non_blocking=True` copy, which returns at once and runs on the current CUDA stream (the caching host
allocator keeps a pinned block alive until the copies that read it have run). The resumable position is
that of the batches handed out (consumed by training), never that of the batches prefetched: each queued
batch carries the wrapped loader's `consumed` after it, and `state_dict()` reports the last one handed
out. So a checkpoint taken mid-run resumes with exactly the batch training would have read next.

The trainer uses it only on CUDA (pinning needs a GPU); on CPU the plain `BatchLoader` stays.
"""

from __future__ import annotations

import queue
import threading
import weakref

import torch

from meshlm.data.dataset import BatchLoader

_POLL_S = 0.1  # how often a producer blocked on a full queue looks at the stop flag


class PrefetchLoader:
    """`BatchLoader`'s batches, `depth` ahead, pinned (`pin`) and copied to `device` (None: left on the host).

    Same interface as `BatchLoader` (`next`, `state_dict`, `load_state_dict`, `consumed`, `mbs`)."""

    def __init__(self, loader: BatchLoader, device: torch.device | str | None = None, depth: int = 2,
                 pin: bool | None = None):
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        self.loader, self.depth = loader, depth
        self.device = torch.device(device) if device is not None else None
        self.pin = (self.device is not None and self.device.type == "cuda") if pin is None else pin
        self._consumed = loader.consumed  # position after the last batch handed out
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    # ---- the producer --------------------------------------------------------------------------------
    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.depth), threading.Event()
        self._thread = threading.Thread(target=_produce, args=(self.loader, self._queue, self._stop, self.pin),
                                        name="meshlm-prefetch", daemon=True)
        self._thread.start()
        # The thread holds no reference to self: when the wrapper is collected, the thread is told to stop.
        weakref.finalize(self, self._stop.set)

    def close(self) -> None:
        """Stop the producer and drop what it prefetched; the position stays that of the batches handed out."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        self._thread = self._queue = self._stop = None
        self.loader.load_state_dict({"consumed": self._consumed})  # rewind what was read ahead

    # ---- BatchLoader's interface ---------------------------------------------------------------------
    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        x, y, self._consumed = item
        if self.device is not None:
            x, y = x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin)
        return x, y

    @property
    def consumed(self) -> int:
        return self._consumed

    @property
    def mbs(self) -> int:
        return self.loader.mbs

    def state_dict(self) -> dict:
        return {"consumed": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._consumed = self.loader.consumed


def _produce(loader: BatchLoader, out: queue.Queue, stop: threading.Event, pin: bool) -> None:
    """Fill `out` with (inputs, targets, position after them) until `stop`; an error is handed on as an item."""
    try:
        while not stop.is_set():
            x, y = loader.next()
            if pin:  # contiguous pinned copies: a strided source would be staged through pageable memory
                x, y = _pinned(x), _pinned(y)
            item = (x, y, loader.consumed)
            while not stop.is_set():
                try:
                    out.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
    except BaseException as err:  # noqa: BLE001 (re-raised in the consumer's thread)
        out.put(err)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
