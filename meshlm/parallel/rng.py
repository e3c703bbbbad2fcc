"""Random streams for tensor parallelism (Megatron's `CudaRNGStatesTracker`, on CPU too).

Dropout on a *replicated* activation (the residual stream without sequence parallelism) must draw the
same mask on every tp rank, or the replicas diverge: it uses the default generator, which every rank
seeds with `train.seed`. Dropout on a *sharded* activation (the attention core, which holds this rank's
heads; the residual stream under sequence parallelism, which holds this rank's tokens) must draw
independent masks per rank, or every shard repeats the same pattern: it runs inside `tracker.tp_rng()`,
which swaps in a second stream seeded with `seed + 2718 + tp_rank` (Megatron's offset) and swaps it out
again, keeping where that stream got to.

The tracker's state travels in checkpoints (`get_state`/`set_state`), so a resumed run draws the masks
the uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

TP_SEED_OFFSET = 2718  # Megatron's offset between the default and the model-parallel stream


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TPRNGTracker:
    """A per-tp-rank random stream for the default generator of `device`, entered with `tp_rng()`."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        saved = _get_state(self.device)
        seed = seed + TP_SEED_OFFSET + tp_rank
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # seed this device's generator, whichever is current
                torch.cuda.manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        self._state = _get_state(self.device)
        _set_state(self.device, saved)

    @contextmanager
    def tp_rng(self) -> Iterator[None]:
        """Run the body with this rank's stream as the default generator, then restore the default one."""
        saved = _get_state(self.device)
        _set_state(self.device, self._state)
        try:
            yield
        finally:
            self._state = _get_state(self.device)
            _set_state(self.device, saved)

    def get_state(self) -> dict:
        return {"tp": self._state.clone()}

    def set_state(self, state: dict) -> None:
        self._state = state["tp"].clone().cpu()
