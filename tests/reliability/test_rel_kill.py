"""kill -9 at random moments of a run that saves every step: the final weights and metrics equal an
uninterrupted run's, bit for bit (issue 13)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from meshlm.checkpoint.single import latest_checkpoint, load_model_state, resolve_checkpoint
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.reliability import forked
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)

STEPS = 32
KILLS = 20
EXACT_KEYS = ("kind", "step", "loss", "lr", "grad_norm", "tokens", "skipped_steps", "val_loss", "val_bpb")


def config(out, async_save: bool = False):
    return tiny_config(out, train={"max_steps": STEPS, "save_every": 1, "keep_last": 2, "sample_tokens": 0,
                                   "async_save": async_save}, model={"dropout": 0.1})


def records(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in EXACT_KEYS if k in r} for r in map(json.loads, lines)]


def _latest_step(out) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (OSError, ValueError, IndexError):
        return 0


def run_and_kill(out, target: int, delay: float, deadline_s: float = 120, async_save: bool = False) -> str | None:
    """Train in a run of the fork server (torch and the trainer already imported there: no start-up cost), and
    SIGKILL it `delay` s after it has published step `target`: kills land at chosen steps however fast the
    machine is, and the delay puts them anywhere in the next step or save. Returns why the kill did not land
    where it was aimed (the run's stacks if it never published its target in `deadline_s`), else None."""
    run = forked.Run(config(out, async_save), out.parent / "stacks")
    start = time.monotonic()
    while _latest_step(out) < target:
        if not run.alive():
            return None  # finished (or died) on its own: the checks after the kills say which
        if time.monotonic() - start > deadline_s:
            stacks = run.stack()
            run.kill()
            return (f"the run did not publish step {target} within {deadline_s} s (its newest: {_latest_step(out)}); "
                    f"its threads then:\n{stacks}")
        time.sleep(0.005)
    time.sleep(delay)
    run.kill()
    return None


# async: the kills land in background writes too (train.async_save: steps run while a checkpoint is written)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill9_at_random_moments_resumes_bit_exactly(tmp_path, async_save):
    ref = tmp_path / "ref"
    Trainer(config(ref)).run()
    out = tmp_path / "killed"
    rng = random.Random(13)
    kills = KILLS // 2 if async_save else KILLS  # half as many with async_save: test_rel_async.py kills one mid-write
    targets = sorted(rng.sample(range(1, STEPS - 1), kills))  # 20 distinct steps of 30, in the order a run reaches them
    reached = []
    for target in targets:
        late = run_and_kill(out, target, rng.uniform(0.0, 0.3), async_save=async_save)  # a step + a save: ~0.1-0.3 s
        assert late is None, late
        found = latest_checkpoint(out)
        reached.append(0 if found is None else int(found.name.split("_")[1]))
    print("kill after step:", targets, "newest valid checkpoint after each kill:", reached)
    assert all(r >= t for r, t in zip(reached, targets)), "each kill came after its target step was published"
    assert sum(r < STEPS for r in reached) >= kills * 3 // 4, f"most kills should land mid-run ({reached})"
    Trainer(config(out, async_save)).run()
    assert records(out) == records(ref)  # every step once, the same losses, norms, rates, evaluation
    a = load_model_state(resolve_checkpoint(ref))
    b = load_model_state(resolve_checkpoint(out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", f"step_{STEPS - 1:07d}", f"step_{STEPS:07d}"]
