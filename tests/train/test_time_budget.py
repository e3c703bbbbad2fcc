"""train.time_budget_s: the step count fitted to measured step times, a schedule that is a pure function of it,
the plan kept on resume, and bad budgets refused with one line."""

import json
import re

import pytest

from meshlm.checkpoint.single import load_part, resolve_checkpoint
from meshlm.core.config import ConfigError
from meshlm.train.budget import REPLAN_EVERY, TimeBudget, decay_start, end_seconds, plan_step, steps_for_budget
from meshlm.train.optim import lr_at
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config


def records(out_dir, kind: str) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_steps_for_budget_fits_the_measured_step_time():
    # 1000 s budget, 50 s spent on set-up and 6 steps, 100 s kept for the end: 850 s of 2 s steps.
    assert steps_for_budget(1000, 2.0, 100, elapsed_s=50, done=6, margin=0) == 6 + 425
    assert steps_for_budget(1000, 2.0, 100, elapsed_s=50, done=6, margin=0.03) == 6 + 412  # 850 / 2.06
    assert steps_for_budget(1000, 4.0, 100, elapsed_s=50, done=6, margin=0) == 6 + 212  # a host twice as slow
    assert steps_for_budget(1000, 2.0, 100, elapsed_s=50, done=6, cap=300, margin=0) == 300  # max_steps caps it
    assert steps_for_budget(100, 2.0, 80, elapsed_s=50, done=6) == 6  # nothing more fits
    with pytest.raises(ValueError):
        steps_for_budget(100, 0.0, 10)


def test_the_plan_is_made_inside_the_warmup_so_the_schedule_depends_on_the_step_count_only():
    long = {"time_budget_s": 60, "max_steps": 5000}
    cfg = tiny_config("unused", train=long, optim={"warmup_steps": 50})
    assert plan_step(0, cfg) == 21  # one untimed step, twenty timed ones
    short = tiny_config("unused", train=long, optim={"warmup_steps": 3})
    assert plan_step(0, short) == 4
    assert plan_step(0, tiny_config("unused", train=long, optim={"warmup_steps": 1})) == 2  # one timed step at least
    assert plan_step(0, tiny_config("unused", train=long, optim={"warmup_steps": 0, "decay": "constant"})) == 21
    assert plan_step(0, tiny_config("unused", train=long, optim={"warmup_steps": 0, "decay_steps": 100})) == 21
    # a run that would end before its plan (train.max_steps 21 or less) plans after its first timed step
    assert plan_step(0, tiny_config("unused", train={**long, "max_steps": 21}, optim={"decay": "constant"})) == 2
    for c in (cfg, short):  # every step taken before the plan has the learning rate of any step count
        for step in range(plan_step(0, c)):
            assert lr_at(step, c.optim, 10) == lr_at(step, c.optim, 10 ** 6), step


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_plan_takes_the_measured_steps_after_the_first():
    cfg = tiny_config("unused", train={"time_budget_s": 1000, "max_steps": 5000, "sample_tokens": 0},
                      optim={"warmup_steps": 50})
    clock = FakeClock(0.0)
    budget = TimeBudget(1000, started=0.0, clock=clock)
    budget.start(0)
    budget.observe(1, 30.0)  # the first step (allocation, warm-up) is not timed
    for step in range(2, 22):
        budget.observe(step, 3.0 if step < 5 else 2.0)  # the first timed steps still settle: the median is 2.0
        assert budget.due(step, cfg) == (step == 21)
    clock.now = 50.0
    line = budget.plan(cfg, 21, n_params=1000, accum=1, device=None, world_size=1)
    reserve, periodic = end_seconds(cfg, 2.0, 1000, 1)
    assert budget.steps == steps_for_budget(1000, 2.0 + periodic, reserve, elapsed_s=50, done=21)
    assert 21 + (950 - 20) / 2.1 < budget.steps < 21 + 950 / 2.0  # the 950 s left, in steps of 2 s and a margin
    assert f": {budget.steps} steps at 2.00 s/step on this host" in line
    assert budget.state() == {"steps": budget.steps, "step_s": 2.0, "budget_s": 1000, "fixed": False}
    # A cosine decay over the run: revised while the warmup lasts (its rates do not depend on the count), then fixed.
    assert budget.settle(cfg, 21) is None and not budget.fixed and budget.due(21 + REPLAN_EVERY, cfg)
    assert budget.settle(cfg, 50) is None and budget.fixed and not budget.due(50 + REPLAN_EVERY, cfg)


def wsd_budget(clock, budget_s=1000, decay="wsd"):
    cfg = tiny_config("unused", train={"time_budget_s": budget_s, "max_steps": 5000, "sample_tokens": 0},
                      optim={"warmup_steps": 5, "decay": decay, "wsd_decay_fraction": 0.2})
    budget = TimeBudget(budget_s, started=0.0, clock=clock)
    budget.start(0)
    return cfg, budget


def run_budget(cfg, budget, clock, step_s, until: int) -> list[int]:
    """Steps of `step_s(step)` seconds on the fake clock, planning and settling as the trainer does, up to the
    planned count or `until`; returns the plan after each step."""
    plans, step = [], 0
    while step < min(until, budget.steps or until):
        step += 1
        clock.now += step_s(step)
        budget.observe(step, step_s(step))
        if budget.due(step, cfg):
            budget.plan(cfg, step, n_params=1000, accum=1, device=None, world_size=1)
        budget.settle(cfg, step)
        plans.append(budget.steps)
        if budget.steps:  # every step taken so far ran at a rate the final schedule gives it
            assert decay_start(cfg, budget.steps) >= step - 1 or budget.fixed
    return plans


def test_a_wsd_plan_follows_a_host_that_speeds_up_until_its_decay_starts():
    # The first 100 steps take 4 s (the hypervisor takes half the CPU), then 2 s: a plan made once from the
    # first steps would stop near 1000/4 steps; revised every REPLAN_EVERY steps it uses the whole budget.
    clock = FakeClock(30.0)  # set-up
    cfg, budget = wsd_budget(clock)
    plans = run_budget(cfg, budget, clock, lambda s: 4.0 if s <= 100 else 2.0, 5000)
    first = plans[20]
    assert first == pytest.approx((1000 - 30 - 21 * 4) / (4 * 1.03) + 21, abs=12)  # the plan from 4 s steps
    assert budget.fixed and budget.steps == plans[-1] == len(plans)
    assert budget.steps > first + 100  # the faster steps were used
    took = clock.now
    reserve, _ = end_seconds(cfg, 2.0, 1000, 1)
    assert 1000 - 50 < took + reserve <= 1000  # ends on the budget, not early
    fixed_at = next(i for i, p in enumerate(plans, 1) if p and i >= decay_start(cfg, p))
    assert set(plans[fixed_at - 1:]) == {budget.steps}  # no change once the decay started
    assert "first plan" in budget.summary(budget.steps)


def test_a_wsd_plan_never_moves_its_decay_before_the_steps_already_taken():
    # Fast until late in the constant phase, then eight times slower: the budget now fits fewer steps than the
    # decay's start allows; the plan shrinks only as far as keeps every step taken at its constant rate.
    clock = FakeClock(0.0)
    cfg, budget = wsd_budget(clock)
    plans = run_budget(cfg, budget, clock, lambda s: 1.0 if s <= 600 else 8.0, 5000)
    assert budget.fixed and len(plans) == budget.steps
    assert decay_start(cfg, budget.steps) >= 599  # the decay starts after the last fast step
    assert budget.steps < max(plans)  # it did shrink


def test_a_constant_rate_is_revised_to_the_end():
    clock = FakeClock(0.0)
    cfg, budget = wsd_budget(clock, decay="constant")
    plans = run_budget(cfg, budget, clock, lambda s: 1.0 if s <= 200 else 0.5, 5000)
    assert len(plans) == budget.steps > plans[20] + 200


def test_a_budget_too_short_for_more_steps_says_so():
    cfg = tiny_config("unused", train={"time_budget_s": 20, "max_steps": 5000}, optim={"warmup_steps": 50})
    budget = TimeBudget(20, started=0.0, clock=FakeClock(19.0))
    budget.start(0)
    for step in range(1, 7):
        budget.observe(step, 2.0)
    with pytest.raises(ConfigError, match=r"train.time_budget_s=20 is too short.*give at least \d+"):
        budget.plan(cfg, 6, n_params=1000, accum=1, device=None, world_size=1)


@pytest.mark.parametrize("value", ["-5", "nan", "inf"])
def test_a_bad_budget_is_refused_with_one_line(value, tmp_path):
    # A ConfigError is the command's one line and exit code 2 (meshlm/cli.py, tests/test_cli.py).
    with pytest.raises(ConfigError, match=rf"^train\.time_budget_s={float(value)} (must be|is not a finite)"):
        tiny_config(tmp_path, train={"time_budget_s": float(value)}).validate()


def test_a_decay_over_the_steps_needs_a_warmup_to_time_steps_in(tmp_path):
    with pytest.raises(ConfigError, match="optim.warmup_steps"):
        Trainer(tiny_config(tmp_path, train={"time_budget_s": 60}, optim={"warmup_steps": 0}))


def test_a_budget_run_follows_its_printed_plan_and_saves_and_evaluates_at_the_end(tmp_path, capsys):
    cfg = tiny_config(tmp_path, train={"time_budget_s": 600, "max_steps": 9, "save_every": 4},
                      optim={"warmup_steps": 3})
    result = Trainer(cfg).run()
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("time budget 10 min (train.time_budget_s=600")  # said first
    n = int(re.search(r"time budget 10 min: (\d+) steps", out).group(1))
    assert 4 <= n <= 9 and result["step"] == n
    train = records(tmp_path, "train")
    assert [r["step"] for r in train] == list(range(1, n + 1))
    for r in train:  # the whole schedule is that of max_steps = n
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg.optim, n), rel=1e-12), r["step"]
    assert [r["step"] for r in records(tmp_path, "eval")] == [n]
    final = resolve_checkpoint(tmp_path)
    assert final.name == f"step_{n:07d}"
    assert load_part(final, "state")["time_budget"]["steps"] == n


def test_a_wsd_budget_run_is_the_run_of_its_final_step_count(tmp_path, capsys):
    cfg = tiny_config(tmp_path, train={"time_budget_s": 600, "max_steps": 40, "log_every": 1},
                      optim={"warmup_steps": 3, "decay": "wsd", "wsd_decay_fraction": 0.5})
    result = Trainer(cfg).run()
    out = capsys.readouterr().out
    n = result["step"]
    assert n == 40  # train.max_steps caps the plans of a tiny model's fast steps
    assert "time budget: 40 steps, fixed: the learning rate decays from step 22 (optim.decay=wsd)" in out
    train = records(tmp_path, "train")
    assert [r["step"] for r in train] == list(range(1, n + 1))
    for r in train:  # revised or not, the whole schedule is that of max_steps = n
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg.optim, n), rel=1e-12), r["step"]
    assert load_part(resolve_checkpoint(tmp_path), "state")["time_budget"]["fixed"]


def test_a_resumed_budget_run_keeps_its_planned_step_count(tmp_path, capsys):
    first = tmp_path / "first"
    Trainer(tiny_config(first, train={"time_budget_s": 600, "max_steps": 8, "save_every": 4, "keep_last": 0},
                        optim={"warmup_steps": 3})).run()
    mid = first / "checkpoints" / "step_0000004"
    assert load_part(mid, "state")["time_budget"]["steps"] == 8
    capsys.readouterr()
    # Resumed with another cap and budget: measuring again would plan up to 40 steps; the plan says 8.
    again = tmp_path / "again"
    resumed = Trainer(tiny_config(again, train={"time_budget_s": 900, "max_steps": 40, "resume": str(mid)},
                                  optim={"warmup_steps": 3}))
    assert resumed.step == 4 and resumed.cfg.train.max_steps == 8
    assert resumed.run()["step"] == 8
    assert "keeping the resumed run's plan of 8 steps" in capsys.readouterr().out
    a = {r["step"]: r for r in records(first, "train")}
    b = {r["step"]: r for r in records(again, "train")}
    assert [s for s in b] == [5, 6, 7, 8]
    for step in b:  # the same schedule and the same training: bit-identical losses and learning rates
        assert (b[step]["loss"], b[step]["lr"]) == (a[step]["loss"], a[step]["lr"]), step
    final_a = load_part(resolve_checkpoint(first), "model")
    final_b = load_part(resolve_checkpoint(again), "model")
    assert all(bool((final_a[k] == final_b[k]).all()) for k in final_a)
