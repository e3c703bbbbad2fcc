"""`torchrun --max-restarts=1` restarts a worker group that lost a worker, and the run resumes by itself.

A tiny two-worker run (gloo, fp32, one thread per worker, train.resume=auto) saves every 4 steps. Once a
checkpoint has been published (`checkpoints/latest`) the test SIGKILLs rank 1's worker process, found among
torchrun's children by its LOCAL_RANK. torchrun must restart the worker group (a worker with
TORCHELASTIC_RESTART_COUNT=1 appears), whose workers resume from the
newest valid checkpoint (rank 0 logs "resumed from …"), and the run must end as an uninterrupted run of the
same layout does: the same per-step losses, bit for bit (metrics.jsonl is cut back to the resumed step, so
every step appears once), and the same final validation loss.

The uninterrupted reference runs the same config in a forked gloo world (tests/parallel/parallel_world.py;
no second torchrun start-up). The torchrun run itself takes 30-90 s on a busy 2-core machine: two workers
start twice (imports, corpus, model) and train 16 steps; the restart is what is tested, so it stays.

Found with it: a restarted group never connected (the agent's store kept the dead group's addresses);
`parallel.mesh.restarted_group_store` keys each attempt apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from meshlm.core.config import load_config
from meshlm.train.trainer import Trainer
from tests.conftest import ROOT
from tests.parallel.parallel_world import run_world

STEPS = 16
ARGS = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
        "--train.global_batch_size=4", "--train.eval_iters=1", "--train.log_every=1", "--train.peak_tflops=1",
        "--train.sample_tokens=0", "--train.progress=false", "--train.precision=fp32", "--train.adapt_threads=false",
        f"--train.max_steps={STEPS}", "--train.save_every=4", "--parallel.timeout_s=60"]
DEADLINE_S = 300


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _published_step(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (OSError, ValueError, IndexError):
        return 0


def _worker(torchrun: psutil.Process, local_rank: str) -> psutil.Process | None:
    for child in torchrun.children(recursive=True):
        try:
            if child.environ().get("LOCAL_RANK") == local_rank:
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _kill_rank_after_checkpoint(proc: subprocess.Popen, out: Path, local_rank: str) -> int:
    """SIGKILL worker `local_rank` of torchrun `proc` once a checkpoint is published; returns the step published
    at the time."""
    agent = psutil.Process(proc.pid)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and proc.poll() is None:
        step = _published_step(out)
        if step and (worker := _worker(agent, local_rank)) is not None:
            os.kill(worker.pid, signal.SIGKILL)
            return step
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint before the run ended or {DEADLINE_S} s passed: {proc.poll()}")


def _restarted_worker(proc: subprocess.Popen) -> bool:
    """Whether torchrun `proc` starts a worker of its second attempt (TORCHELASTIC_RESTART_COUNT=1) before it ends."""
    agent = psutil.Process(proc.pid)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and proc.poll() is None:
        for child in agent.children(recursive=True):
            try:
                if child.environ().get("TORCHELASTIC_RESTART_COUNT") == "1":
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.05)
    return False


def _reference(rank, world, out_dir):
    Trainer(load_config("gpt-tiny", [*ARGS, f"--train.out_dir={out_dir}/run"])).run()


def test_torchrun_restarts_a_killed_worker_and_the_run_resumes_to_the_same_losses(tmp_path):
    out = tmp_path / "restarted"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "meshlm", "train", "--config", "gpt-tiny", *ARGS, f"--train.out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        killed_at = _kill_rank_after_checkpoint(proc, out, local_rank="1")
        restarted = _restarted_worker(proc)
        stdout, stderr = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert killed_at < STEPS, "the kill landed before the end"
    assert proc.returncode == 0, stderr[-4000:]
    assert restarted, "torchrun started the worker group again"
    resumed = [line for line in stdout.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1, stdout[-4000:]
    step = int(resumed[0].rsplit(" ", 1)[1])
    assert killed_at <= step < STEPS and step % 4 == 0, resumed  # the newest checkpoint when the group restarted

    run_world(_reference, 2, tmp_path / "straight")
    ref = tmp_path / "straight" / "run"
    got, want = _records(out, "train"), _records(ref, "train")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "each step once: metrics cut back on resume"
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert got[-1]["loss"] == want[-1]["loss"]
    assert [r["val_loss"] for r in _records(out, "eval")] == [r["val_loss"] for r in _records(ref, "eval")]
