"""`train.time_budget_s`: a run that fits its step count, and with it the learning-rate schedule, to a time budget.

The budget covers the whole command as a user waits for it: from the start of `meshlm train` (data preparation,
model set-up and the first steps included) to the end of the final evaluation, checkpoint and sample. The run
times its first steps (the first one, which allocates and warms caches, is not timed), then plans the step
count N (`steps_for_budget`): from then on the run is exactly the run of `train.max_steps = N`.

When the plan may change is a matter of the schedule: the learning rate of every step already taken must be the
one the run of `train.max_steps = N` would have used, for the final N.

* A cosine or linear decay over the run depends on N from the end of the warmup: the plan is made once, inside
  the warmup, and fixed.
* A WSD schedule (`optim.decay = "wsd"`) is constant until its decay starts, at N − ⌊fraction · N⌋: the plan is
  made at the same point, then revised every `REPLAN_EVERY` steps from the latest step times and the time
  actually spent, for as long as the decay has not begun (a revised N never moves the decay's start before the
  step about to be taken). When the decay starts, N is fixed. A host whose speed changes early in the run (another
  job ends, the hypervisor takes less) still ends on its budget.
* A constant rate, or a decay over `optim.decay_steps`, does not depend on N at all: revised until the last steps.

N is stored in the checkpoints and a resumed run keeps it, fixed (it is not measured again). With several
processes every rank takes the slowest rank's step time and elapsed time (an all-reduce), so all agree.

`train.max_steps` is the cap: the data are prepared for that many steps, and a fast host stops there.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshlm.core.config import Config, ConfigError

TIMED_STEPS = 20  # steps timed after the first (untimed) one before the plan is made (their median counts)
REPLAN_EVERY = 10  # steps between revisions of a plan that may still change (the last TIMED_STEPS steps' median)
MARGIN = 0.03  # the steps' share of the budget kept for step times that drift during the run
SAVE_BYTES_PER_S = 100e6  # a conservative disk (checkpoint writes, with their checksums)


def steps_for_budget(budget_s: float, step_s: float, reserve_s: float, elapsed_s: float = 0.0, done: int = 0,
                     cap: int = 0, margin: float = MARGIN) -> int:
    """The run's total step count: `done` steps taken after `elapsed_s` seconds, then as many steps of
    `step_s` seconds (plus `margin` of each) as fit in `budget_s` with `reserve_s` kept for the end; at most
    `cap` (0: no cap), never fewer than `done`."""
    if step_s <= 0:
        raise ValueError(f"step time {step_s} must be positive")
    left = budget_s - elapsed_s - reserve_s
    more = math.floor(left / (step_s * (1 + margin))) if left > 0 else 0
    total = done + max(0, more)
    return min(total, cap) if cap > 0 else total


def decays_over_steps(cfg: Config) -> bool:
    """Whether the learning rate after the warmup depends on train.max_steps (a cosine or linear decay
    without optim.decay_steps)."""
    return cfg.optim.decay in ("cosine", "linear") and not cfg.optim.decay_steps


def check_budget_schedule(cfg: Config) -> None:
    """A budget with a decay over the run's steps needs a warmup to time steps in: lr_at(s) for s <=
    optim.warmup_steps does not depend on the step count, so the plan made there leaves the schedule whole."""
    if cfg.train.time_budget_s > 0 and decays_over_steps(cfg) and cfg.optim.warmup_steps < 1:
        raise ConfigError(f"train.time_budget_s={cfg.train.time_budget_s:g} with optim.decay={cfg.optim.decay!r} "
                          "needs optim.warmup_steps >= 1 (the run times its first steps before it fixes the "
                          "step count the decay spans); set optim.warmup_steps=5, or optim.decay_steps")


def plan_step(start: int, cfg: Config) -> int:
    """The step count after which a run starting at step `start` makes its plan: one untimed step and
    `TIMED_STEPS` timed ones, but no later than the learning rate starts to depend on the step count (a
    cosine or linear decay over train.max_steps begins after optim.warmup_steps), and after the first timed
    step for a run that would end before it planned (train.max_steps up to start + 1 + TIMED_STEPS: such a run
    overran its budget without a word); at least one timed step."""
    plan = start + 1 + TIMED_STEPS
    if decays_over_steps(cfg):
        plan = min(plan, cfg.optim.warmup_steps + 1)  # lr_at(s) for s <= warmup_steps does not depend on the total
    if cfg.train.max_steps <= plan:  # revised later where the schedule allows (constant, WSD)
        plan = start + 2
    return max(plan, start + 2)


class BudgetTooShort(ConfigError):
    """A budget in which not even one more step fits: the run stops with one line (exit code 2), and a run
    refused at its first step leaves nothing behind (`Trainer.run`)."""


def too_short(budget_s: float, step: int, elapsed: float, step_s: float, reserve: float) -> BudgetTooShort:
    """The one-line refusal, with the least budget that allows 20 steps on this host."""
    need = elapsed + reserve + 20 * step_s
    return BudgetTooShort(
        f"train.time_budget_s={budget_s:g} is too short: set-up and {step} step(s) took {elapsed:.0f} s, a step "
        f"takes {step_s:.2f} s on this host and the end (evaluation, checkpoint, sample) about {reserve:.0f} s; "
        f"give at least {math.ceil(need)} (20 steps) or set train.max_steps instead")


def end_seconds(cfg: Config, step_s: float, n_params: int, accum: int) -> tuple[float, float]:
    """Estimates from the measured step time: (seconds kept for the end of the run: the final evaluation,
    checkpoint and sample; seconds each step adds for the periodic evaluations and checkpoints)."""
    t = cfg.train
    # A micro-batch's forward, generously: a third of its share of a step (the demo's evaluation, 10 micro-batches,
    # took 4.3 s at 2.8 s a step on 2 cores; this says 9.3 s).
    forward = step_s / max(1, accum) / 3
    evaluation = t.eval_iters * forward
    save = 1.0 + n_params * 4 * 3 / SAVE_BYTES_PER_S  # weights and optimizer states in fp32
    # One token at a time with a KV cache: far less efficient than training's batches (the demo's 200-token
    # sample took 2.5 s at 2.8 s a step: 20× a training token's share); 2 ms a token at least.
    per_token = max(0.002, 20 * step_s / (t.global_batch_size * cfg.model.seq_len))
    sample = t.sample_tokens * per_token
    reserve = evaluation + save + sample + 1.0  # + leaving the process groups and exiting
    periodic = (evaluation / t.eval_every if t.eval_every else 0.0) + (save / t.save_every if t.save_every else 0.0)
    return reserve, periodic


def duration(seconds: float) -> str:
    """`seconds` for a person: 45 s, 23 min, 1 h 05 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def decay_start(cfg: Config, steps: int) -> int:
    """The first step (0-based) from which the learning rate of a run of `steps` steps depends on `steps`
    (`optim.lr_at`): the end of the warmup for a cosine or linear decay over the run, WSD's decay start, and
    never (`steps`) for a constant rate or a decay over optim.decay_steps. A step up to this one has the same
    rate whatever the step count."""
    o = cfg.optim
    if o.decay == "constant" or o.decay_steps:
        return steps
    if o.decay == "wsd":
        return steps - int(o.wsd_decay_fraction * steps)
    return o.warmup_steps


def keep_schedule(cfg: Config, steps: int, step: int) -> int:
    """`steps`, or more: the least step count from `steps` on whose schedule agrees with every step taken so
    far (`step` of them, run at the rates that did not depend on the count), so that the run stays exactly the
    run of that many steps. WSD's decay start grows with the count, by at most one per step."""
    while cfg.optim.decay == "wsd" and not cfg.optim.decay_steps and decay_start(cfg, steps) < step - 1:
        steps += 1
    return steps


@dataclasses.dataclass
class TimeBudget:
    """A run's budget: created when train.time_budget_s is set, with the command's start on `clock` (seconds);
    `observe` takes each step's time, `due` says when to `plan` (the first plan, then the revisions the schedule
    allows), `settle` fixes the plan once the schedule depends on it (module doc)."""

    budget_s: float
    started: float
    clock: Callable[[], float] = time.monotonic
    steps: int = 0  # the planned step count; 0 until planned
    step_s: float = 0.0  # the measured seconds per step
    first_step: int = -1  # the step the run started at (set by `start`)
    times: list = dataclasses.field(default_factory=list)
    fixed: bool = False  # the plan can no longer change (the schedule depends on it, or a resumed plan)
    first_plan: int = 0  # the first plan's step count (the summary line compares)
    planned_at: int = 0  # the step of the latest plan
    cap: int = 0  # train.max_steps as the run started (the planned count replaces it in the config)

    def start(self, step: int) -> None:
        self.first_step = step

    @property
    def planned(self) -> bool:
        return self.steps > 0

    def observe(self, step: int, seconds: float) -> None:
        """Step `step` (1-based, just taken) took `seconds`; the first step of the run is not timed."""
        if step > self.first_step + 1:
            self.times.append(seconds)

    def due(self, step: int, cfg: Config) -> bool:
        if not self.planned:
            return step >= plan_step(self.first_step, cfg)
        return not self.fixed and step - self.planned_at >= REPLAN_EVERY

    def check_first_step(self, cfg: Config, step: int, seconds: float, n_params: int, accum: int,
                         device: torch.device, world_size: int) -> None:
        """After the run's first (untimed) step: refuse a budget the set-up and that step have spent already,
        where not even one more step fits (measured with the first step's time, an upper bound), before any
        timed step and before anything is saved (it was refused only at the plan, after 21 timed steps)."""
        if self.planned or step != self.first_step + 1:
            return
        step_s, elapsed = self.slowest(seconds, device, world_size)
        reserve, periodic = end_seconds(cfg, step_s, n_params, accum)
        if steps_for_budget(self.budget_s, step_s + periodic, reserve, elapsed, done=step) <= step < cfg.train.max_steps:
            raise too_short(self.budget_s, step, elapsed, step_s + periodic, reserve)

    def slowest(self, step_s: float, device: torch.device, world_size: int) -> tuple[float, float]:
        """(`step_s`, seconds since the start), the slowest rank's on every rank."""
        elapsed = self.clock() - self.started
        if world_size > 1:
            both = torch.tensor([step_s, elapsed], dtype=torch.float64, device=device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            step_s, elapsed = both.tolist()
        return step_s, elapsed

    def measure(self, device: torch.device, world_size: int) -> tuple[float, float]:
        """(seconds per step: the median of the last TIMED_STEPS steps; seconds since the start), the slowest
        rank's on every rank."""
        step_s = statistics.median(self.times[-TIMED_STEPS:])  # the first steps run slower while caches settle
        return self.slowest(step_s, device, world_size)

    def plan(self, cfg: Config, step: int, n_params: int, accum: int, device: torch.device,
             world_size: int) -> str | None:
        """Plan (or revise) the step count, every rank the same; returns the line to print (None: a revision
        that changed nothing worth saying)."""
        step_s, elapsed = self.measure(device, world_size)
        reserve, periodic = end_seconds(cfg, step_s, n_params, accum)
        cap = self.cap if self.planned else cfg.train.max_steps
        fit = steps_for_budget(self.budget_s, step_s + periodic, reserve, elapsed, done=step)
        if not self.planned and fit <= step < cap:
            raise too_short(self.budget_s, step, elapsed, step_s + periodic, reserve)
        before, self.step_s, self.planned_at = self.steps, step_s, step
        self.steps = keep_schedule(cfg, min(fit, cap), step)
        total = elapsed + (self.steps - step) * (step_s + periodic) + reserve
        capped = f" (train.max_steps caps it; ~{fit} would fit)" if fit > cap else ""
        if before:
            if abs(self.steps - before) < max(3, 0.01 * before):
                return None
            return (f"time budget: {self.steps} steps now (was {before}){capped}: {step_s:.2f} s/step over the last "
                    f"{min(TIMED_STEPS, len(self.times))} steps, {elapsed:.0f} s spent, about {duration(total)} in all")
        self.first_plan, self.cap = self.steps, cap
        done_at = time.strftime("%H:%M", time.localtime(time.time() + total - elapsed))
        note = ""
        if decays_over_steps(cfg) and step - 1 > cfg.optim.warmup_steps:  # resumed past the warmup, no plan saved
            note = f"; note: steps up to {step} followed the schedule of train.max_steps={cap}"
        return (f"time budget {duration(self.budget_s)}: {self.steps} steps{capped} at {step_s:.2f} s/step on "
                f"this host, about {duration(total)} in all (done about {done_at}; {reserve:.0f} s kept for "
                f"the final evaluation, checkpoint and sample){note}")

    def settle(self, cfg: Config, step: int) -> str | None:
        """Fix the plan when the next step's learning rate depends on it; returns the line to print then."""
        if self.fixed or not self.planned or step < decay_start(cfg, self.steps):
            return None
        self.fixed = True
        if cfg.optim.decay != "wsd":
            return None  # fixed by the first plan itself (a cosine or linear decay over the run)
        return (f"time budget: {self.steps} steps, fixed: the learning rate decays from step {step + 1} "
                f"(optim.decay=wsd)")

    def keep(self, saved: dict, cap: int) -> None:
        """A resumed run's plan (a checkpoint's `state()`), fixed: it is not measured again."""
        self.steps = self.first_plan = min(saved["steps"], cap)
        self.step_s, self.fixed, self.cap = saved["step_s"], True, cap

    def state(self) -> dict:
        """What checkpoints keep: the plan (a resumed run keeps it)."""
        return {"steps": self.steps, "step_s": self.step_s, "budget_s": self.budget_s, "fixed": self.fixed}

    def summary(self, step: int) -> str:
        """The last line: the steps taken and the time the whole run took."""
        took = self.clock() - self.started
        first = f" (first plan {self.first_plan})" if self.first_plan and self.first_plan != step else ""
        over = f", {took - self.budget_s:.0f} s over it" if took > self.budget_s + 0.5 else ""
        return (f"time budget {duration(self.budget_s)}: {step} steps{first}, done after {took:.0f} s of "
                f"{self.budget_s:.0f} s{over}")


def with_steps(cfg: Config, steps: int) -> Config:
    """`cfg` with train.max_steps = `steps` (the planned run)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps))
