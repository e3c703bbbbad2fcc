"""Shared fixtures: a tiny config, a small real corpus slice, and a subprocess runner for the CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from meshlm.core.config import Config, build

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    """The layout fuzz's random set (tests/parallel/test_layout_fuzz.py): off unless --fuzz-n is given."""
    group = parser.getgroup("meshlm layout fuzz")
    group.addoption("--fuzz-n", type=int, default=0, help="random parallel layouts to run against one process")
    group.addoption("--fuzz-seed", type=int, default=0, help="seed of the random layouts (default 0)")


def session_cache_dir(tmp_path_factory) -> Path:
    """The one $MESHLM_CACHE of a test run (prepared corpora, tokenizers, GGUF imports, eval sets), never the
    user's ~/.cache. Under pytest-xdist every worker uses the controller's base directory, so the corpus is
    tokenized and SmolLM2's GGUF imported once per run, not once per worker: meshlm's caches are safe for
    concurrent builders (per-process temporary files, atomic renames)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # xdist's worker base is <the controller's base>/<worker id>
    return base / "meshlm-cache"


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """$MESHLM_CACHE set for the whole session, so that module fixtures (set up before any function-scoped
    fixture) and the commands they start find the same cache as the tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHLM_CACHE", str(session_cache_dir(tmp_path_factory)))
        yield


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """The session's cache again for each test (a test may change the variable; its monkeypatch undoes that)."""
    monkeypatch.setenv("MESHLM_CACHE", str(session_cache_dir(tmp_path_factory)))


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


# A command run with SIGINT at its default disposition, as a terminal starts a command: prefix it with
# `[sys.executable, "-c", SIGINT_DEFAULT]`. A process started with SIGINT ignored (anything launched with `&` from a
# non-interactive shell, e.g. `make test &` in CI, and everything it starts) keeps ignoring it: Python installs its
# KeyboardInterrupt handler only over SIG_DFL, so Ctrl-C would then be ignored by design, as by any Unix program.
# exec keeps SIG_DFL.
SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.argv[1], sys.argv[1:])")


def meshlm_command() -> list[str]:
    """The installed `meshlm` console script next to this interpreter (as the README runs it)."""
    script = Path(sys.executable).parent / "meshlm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "meshlm"]


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*meshlm_command(), *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def run_shell(script: str, timeout: float, *, input: str | None = None, env: dict | None = None,
              cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`bash -c script` (a documented session: a server started with `&`, requests, `kill %1`) in its own
    process group, its output in temporary files, and the whole group killed when it ends or after `timeout`
    s. With pipes and `subprocess.run`, a command that failed under `set -e` (or hung) left the server behind
    holding the pipe, and the test waited on it until pytest's 20 minutes. A script killed at its timeout
    returns code -9 with a line saying so at the end of its stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=out,
                                stderr=err, text=True, start_new_session=True)
        try:
            proc.communicate(input, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = -9
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stderr = err.read() + (f"\n[still running after {timeout} s: killed with its process group]" if code == -9
                               else "")
        return subprocess.CompletedProcess(["bash", "-c", script], code, out.read(), stderr)
