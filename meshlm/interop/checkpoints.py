"""The door every command opens a `--checkpoint` through: meshlm's own checkpoints, and other formats.

    open_checkpoint("runs/gpt")                 a run directory, its checkpoints/, a step directory, or
                                                `meshlm convert --to-single` output: `checkpoint.load.open_checkpoint`
    open_checkpoint("SmolLM2-135M.Q4_1.gguf")   a GGUF file: converted once into a meshlm run directory under
                                                $MESHLM_CACHE/gguf/ (`interop.gguf.cached_import`), then opened

Either way the command gets one frozen `Checkpoint`, resolved and verified once, and passes it down. This
module lives in interop/ (above checkpoint/ in the layers) because converting a foreign format is interop's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshlm.checkpoint import load
from meshlm.checkpoint.load import Checkpoint
from meshlm.families.registry import get_spec  # passed down: a step whose weights disagree with its config is invalid

GGUF_SUFFIX = ".gguf"


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def open_checkpoint(path: str | Path, log: Callable[[str], None] | None = _stderr) -> Checkpoint:
    """The `Checkpoint` of `path`: a `.gguf` file is converted into a cached run directory first (once; later
    calls reuse it), anything else is opened as a meshlm checkpoint. Notes (a checkpoint passed over, a
    conversion) go to `log`."""
    if str(path).lower().endswith(GGUF_SUFFIX):
        from meshlm.interop.gguf import cached_import  # lazily: the GGUF reader loads only for a GGUF file

        run = cached_import(path, log or (lambda text: None))
        return replace(load.open_checkpoint(run, log=log, spec_of=get_spec), given=str(path))
    return load.open_checkpoint(path, log=log, spec_of=get_spec)
