"""The process's random streams (Python's, NumPy's, torch's CPU and CUDA generators): seeding them, and
their state for a checkpoint (`rng_state`) and back (`set_rng_state`), so a resumed run draws the very
numbers (dropout masks, data order) the uninterrupted one would have.

The tensor-parallel dropout stream is `parallel.rng.TPRNGTracker`'s, saved beside these. `deterministic_algorithms`
is `train.deterministic`'s switch for torch's kernels.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def rng_state() -> dict:
    """Every global generator's state: {"python", "numpy", "torch"} and, with a CUDA device, "cuda" (all of them)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the generators from `rng_state()`'s dict (its CUDA states only where CUDA is available)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (modulo 2^32) and torch's generators (every device's) with `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """`train.deterministic`: inside the block torch uses deterministic algorithms only (an operation without one
    stops with torch's error naming it) and cuDNN does not benchmark; the process's previous settings after."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]
