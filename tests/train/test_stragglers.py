"""Straggler reports (train.straggler_every, train.straggler_ratio; meshlm/train/stragglers.py).

Two data-parallel ranks (forked gloo world, tests/parallel/parallel_world.py) train the tiny model. In the
slow run the test, not the product, makes rank 1 slow: its trainer's forward is wrapped with a 0.5 s sleep
(a step of the tiny model computes in about 0.1 s on a busy 2-core machine), so rank 1's compute time is
several times rank 0's while rank 0 waits for it in the gradient reduction. Rank 0's log and metrics.jsonl
must name rank 1 with its host; a balanced run of the same shape must name nobody. The threshold is 3 for
both (rank 1 is slowed about 5x; two balanced ranks sharing two busy cores measured within 1.5x).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from meshlm.core.config import ConfigError
from meshlm.train.stragglers import find_stragglers, straggler_line
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.parallel.parallel_world import run_world

SLEEP_S = 0.5
EVERY = 2
RATIO = 3.0


def _train(rank: int, world: int, out_dir: str, slow_rank: int | None) -> list[str]:
    cfg = tiny_config(f"{out_dir}/run", train={"max_steps": 2 * EVERY, "straggler_every": EVERY,
                                              "straggler_ratio": RATIO, "save_every": 0},
                      parallel={"heartbeat_s": 0, "timeout_s": 60})
    trainer = Trainer(cfg)
    if rank == slow_rank:
        forward = trainer.forward

        def slow_forward(*args, **kwargs):
            time.sleep(SLEEP_S)
            return forward(*args, **kwargs)

        trainer.forward = slow_forward
    lines: list[str] = []
    if rank == 0:  # rank 0's log lines, returned to the test (the other ranks log nothing)
        trainer.runlog.log = lines.append
    trainer.run()
    return lines


def _slow(rank, world, out_dir):
    return _train(rank, world, out_dir, slow_rank=1)


def _balanced(rank, world, out_dir):
    return _train(rank, world, out_dir, slow_rank=None)


def _records(out_dir) -> list[dict]:
    lines = (out_dir / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "stragglers"]


def test_a_slowed_rank_is_named_with_its_host_in_the_log_and_metrics(tmp_path):
    logs = run_world(_slow, 2, tmp_path)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [EVERY, 2 * EVERY], "one report per window, the slow rank in each"
    for rec in records:
        assert [s["rank"] for s in rec["slow"]] == [1]
        slow = rec["slow"][0]
        assert slow["host"] == socket.gethostname()
        assert slow["ratio"] > RATIO and slow["compute_s"] >= SLEEP_S  # one micro-batch per step and rank
        assert rec["window_steps"] == EVERY and rec["threshold"] == RATIO
    named = [line for line in logs[0] if line.startswith("stragglers at step")]
    assert len(named) == 2 and all(f"rank 1 ({socket.gethostname()})" in line for line in named), logs[0]
    assert "rank 0 (" not in " ".join(named)


def test_a_balanced_run_names_nobody(tmp_path):
    logs = run_world(_balanced, 2, tmp_path)
    assert _records(tmp_path) == []
    assert not [line for line in logs[0] if "straggler" in line]
    assert any(line.startswith("step ") for line in logs[0]), "the run did log its steps"


def test_ranks_are_compared_within_their_pipeline_stage():
    # Stage 0 (ranks 0, 1) computes 1 s, stage 1 (ranks 2, 3) 4 s a step: a pipeline's stages differ by design.
    means = [[1.0, 0.1, 0.0], [1.1, 0.0, 0.0], [4.0, 0.2, 0.0], [9.0, 0.0, 0.0]]
    rec = find_stragglers(means, ["a", "b", "c", "d"], stage_size=2, ratio=1.5, step=10, steps=5)
    assert [(s["rank"], s["host"], s["ratio"]) for s in rec["slow"]] == [(3, "d", 9.0 / 4.0)]
    assert "rank 3 (d) 2.2x" in straggler_line(rec)
    assert find_stragglers(means[:2], ["a", "b"], stage_size=2, ratio=1.5, step=10, steps=5) is None


@pytest.mark.parametrize(("key", "value"), [("straggler_every", -1), ("straggler_ratio", 1.0),
                                            ("straggler_ratio", float("nan"))])
def test_bad_straggler_settings_are_one_clear_error(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"train.{key}="):
        tiny_config(tmp_path, train={key: value})
