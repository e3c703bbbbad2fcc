"""Shared fixtures: a tiny config, a small real corpus slice, and a subprocess runner for the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.core.config import Config, build

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    """The layout fuzz's random set (tests/parallel/test_layout_fuzz.py): off unless --fuzz-n is given."""
    group = parser.getgroup("meshlm layout fuzz")
    group.addoption("--fuzz-n", type=int, default=0, help="random parallel layouts to run against one process")
    group.addoption("--fuzz-seed", type=int, default=0, help="seed of the random layouts (default 0)")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """Tokenized-corpus cache shared by the whole session, never the user's ~/.cache."""
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path_factory.getbasetemp() / "meshlm-cache"))


def tiny_config(out_dir: str | Path, **sections) -> Config:
    """A model small enough for a few CPU steps in well under a second each."""
    values = {
        "model": {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 32, "vocab_size": 50257},
        # precision and fused_loss pinned (their defaults are `auto`, resolved by host and shape): the tests
        # compare numbers at fp32 tolerances, through the fused head.
        "train": {"max_steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "out_dir": str(out_dir),
                  "log_every": 1, "eval_every": 0, "eval_iters": 2, "progress": False, "peak_tflops": 1.0,
                  "precision": "fp32", "fused_loss": True},
        "optim": {"warmup_steps": 2, "lr": 1e-3},
        "data": {},
    }
    for name, changes in sections.items():
        values.setdefault(name, {}).update(changes)
    return build(values)


def meshlm_command() -> list[str]:
    """The installed `meshlm` console script next to this interpreter (as the README runs it)."""
    script = Path(sys.executable).parent / "meshlm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "meshlm"]


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*meshlm_command(), *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
