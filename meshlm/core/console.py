"""Who speaks in a torchrun world: rank 0 prints and writes, the other ranks stay quiet.

Torch-free: reads the `RANK` variable torchrun sets (0, or unset for a single process)."""

from __future__ import annotations

import os


def is_main() -> bool:
    """Whether this process is rank 0 of its torchrun world (or runs alone): the one that prints and writes."""
    return int(os.environ.get("RANK", "0")) == 0


def say(text: str) -> None:
    """Print `text` (flushed) on rank 0 only."""
    if is_main():
        print(text, flush=True)
