"""train.out_dir as a run found it, so that a refused run leaves nothing behind.

A config error found at set-up (after the directory was created: a key the model family does not support, a
vocabulary smaller than the tokenizer's) or a time budget refused at the first step used to leave an empty
directory, or its log files, behind. `OutDir.create` records what the directory held (or which directories it
had to create), `remove_created` removes only what this run added: never a file that was there before, never a
saved checkpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from meshlm.checkpoint.files import checkpoints_dir


@dataclass
class OutDir:
    """The run's output directory, `before` its entries when the run started (None: the run created it, and
    every missing directory from `top` down)."""

    path: Path
    before: set | None
    top: Path

    @classmethod
    def create(cls, path: str | Path) -> OutDir:
        """Record what `path` holds, then create it (and its missing parents)."""
        path = Path(path)
        before = set(path.iterdir()) if path.is_dir() else None
        top = path.absolute()
        while not top.parent.exists():
            top = top.parent
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, before, top)

    def remove_created(self) -> None:
        """Remove the entries this run added (a non-empty checkpoints directory is kept), then the directories
        it created while they are empty. Rank 0's job: call it on rank 0 only."""
        if not self.path.is_dir():
            return
        for entry in set(self.path.iterdir()) - (self.before or set()):
            if entry == checkpoints_dir(self.path) and any(entry.iterdir()):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if self.before is not None:
            return
        path = self.path.absolute()
        while path.is_dir() and not any(path.iterdir()):
            path.rmdir()
            if path == self.top:
                break
            path = path.parent
