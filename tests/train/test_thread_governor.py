"""train.adapt_threads: torch's thread count follows the CPUs other processes leave free (train/threads.py),
decided from CPU accounting over windows, two windows in a row, never over the user's choice."""

import os
import shutil
import signal
import time

import pytest
import torch

from meshlm.train import threads
from meshlm.train.threads import ThreadGovernor, threads_for


class FakeMachine:
    """A clock, the machine's busy CPU seconds and this process's CPU seconds, advanced by `run`."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0
        self.set_to: list[int] = []

    def run(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.now += seconds
        self.own += own_cpus * seconds
        self.busy += (own_cpus + other_cpus) * seconds

    def governor(self, most=2, cpus=2) -> ThreadGovernor:
        return ThreadGovernor(most, cpus, window_s=2.0, clock=lambda: self.now, busy=lambda: self.busy,
                              own=lambda: self.own, set_threads=self.set_to.append)


def test_threads_for_is_the_share_of_the_cpus_left():
    assert threads_for(2, 2, 0.0) == 2 and threads_for(2, 2, 0.3) == 2
    assert threads_for(2, 2, 1.0) == 1 and threads_for(2, 2, 2.0) == 1  # at least one
    assert threads_for(8, 16, 8.0) == 4  # torch's 8 threads on 16 logical CPUs, half of them taken
    assert threads_for(4, 4, 1.0) == 3


def test_alone_nothing_changes():
    m = FakeMachine()
    g = m.governor()
    for _ in range(20):  # steps of 1 s using both CPUs, a little system noise beside
        m.run(1.0, own_cpus=1.95, other_cpus=0.05)
        assert g.after_step() is None
    assert m.set_to == [] and g.threads == 2 and g.others == pytest.approx(0.05)


def test_a_busy_process_takes_a_thread_and_gives_it_back_when_it_ends():
    m = FakeMachine()
    g = m.governor()
    lines = []
    for step in range(30):
        busy = 8 <= step < 20  # another process holds one CPU from 8 s to 20 s
        m.run(1.0, own_cpus=1.0 if busy else 1.95, other_cpus=1.0 if busy else 0.02)
        lines.append(g.after_step())
    said = [(i, line) for i, line in enumerate(lines) if line]
    assert m.set_to == [1, 2]
    (down, first), (up, second) = said
    assert 8 < down <= 12 and "other processes use 1.0 of 2 CPUs; torch threads 2 → 1" in first
    assert 20 < up <= 24 and "the CPUs are free again" in second and "torch threads 1 → 2" in second


def test_one_window_of_load_does_not_move_it():
    m = FakeMachine()
    g = m.governor()
    for step in range(12):
        m.run(1.0, own_cpus=1.0 if step in (4, 5) else 1.95, other_cpus=1.0 if step in (4, 5) else 0.0)
        g.after_step()
    assert m.set_to == []


LINUX_ACCOUNTING = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the governor reads /proc/stat (Linux)")


@LINUX_ACCOUNTING
def test_it_is_off_where_the_user_chose_or_off_a_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert threads.thread_governor(True, torch.device("cpu")) is not None
    assert threads.thread_governor(False, torch.device("cpu")) is None
    assert threads.thread_governor(True, torch.device("cuda")) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert threads.thread_governor(True, torch.device("cpu")) is None  # nothing to give
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.thread_governor(True, torch.device("cpu")) is None


@LINUX_ACCOUNTING
def test_the_machines_busy_time_counts_this_process():
    busy0, own0 = threads.cpu_busy_seconds(), time.process_time()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    busy1, own1 = threads.cpu_busy_seconds(), time.process_time()
    assert busy1 - busy0 >= (own1 - own0) - 0.03  # the clock ticks at 100 Hz: 10 ms per tick, a few ticks of slack


def test_the_training_loop_asks_the_governor_after_every_step(tmp_path, monkeypatch, capsys):
    from meshlm.train import trainer as trainer_module
    from tests.conftest import tiny_config

    clock = {"now": 0.0}

    def tick() -> float:  # each step takes a second of the fake clock, while another process holds one CPU
        clock["now"] += 1.0
        return clock["now"]

    governor = ThreadGovernor(2, 2, window_s=2.0, clock=tick, busy=lambda: 2.0 * clock["now"],
                              own=lambda: clock["now"])
    monkeypatch.setattr(trainer_module, "thread_governor", lambda enabled, device: governor if enabled else None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        trainer_module.Trainer(tiny_config(tmp_path, train={"max_steps": 8, "log_every": 1})).run()
    finally:
        torch.set_num_threads(before)
    assert "other processes use 1.0 of 2 CPUs; torch threads 2 → 1" in capsys.readouterr().out
    import json
    counts = [json.loads(line).get("threads") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "train"]
    assert counts[0] == 2 and counts[-1] == 1


class BusyHostGovernor(ThreadGovernor):
    """A governor on a host where another process holds one of 2 CPUs all along: each call of its clock is one
    second later, and the machine is busy 2 CPU-seconds a second, one of them this process's. `kill_after`:
    the run is stopped (SIGTERM, saved at the step boundary) after that many steps."""

    def __init__(self, kill_after: int = 0):
        clock = {"now": 0.0}

        def tick() -> float:
            clock["now"] += 1.0
            return clock["now"]

        super().__init__(2, 2, window_s=2.0, clock=tick, busy=lambda: 2.0 * clock["now"], own=lambda: clock["now"])
        self.kill_after, self.steps = kill_after, 0

    def after_step(self, *step):
        self.steps += 1  # counted here: a resumed run's governor sees the steps after its checkpoint only
        if self.steps == self.kill_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().after_step(*step)


def _train(cfg, monkeypatch, kill_after: int = 0) -> list[dict]:
    """Run `cfg` with 2 torch threads to start, on the busy host (`BusyHostGovernor`); the train records of
    metrics.jsonl."""
    import json

    from meshlm.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "thread_governor",
                        lambda enabled, device: BusyHostGovernor(kill_after) if enabled else None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        trainer_module.Trainer(cfg).run()
    finally:
        torch.set_num_threads(before)
    out = cfg.train.out_dir
    return [r for r in map(json.loads, open(f"{out}/metrics.jsonl").read().splitlines()) if r["kind"] == "train"]


def _weights(out) -> dict:
    from meshlm.checkpoint.single import load_model_state, resolve_checkpoint

    return load_model_state(resolve_checkpoint(out))


def test_a_run_killed_on_a_busy_host_resumes_with_its_thread_count_bit_exactly(tmp_path, monkeypatch):
    """The governor went to 1 thread before the checkpoint (step 4); the resumed run, on the same busy host,
    runs steps 5-8 with that count from the first (before: torch's 2 again, until two windows agreed), so every
    step's thread count, loss and gradient norm and the final weights equal the uninterrupted run's."""
    from tests.conftest import tiny_config

    keys = {"log_every": 1, "adapt_threads": True}
    straight = _train(tiny_config(tmp_path / "straight", train={**keys, "max_steps": 8}), monkeypatch)
    _train(tiny_config(tmp_path / "split", train={**keys, "max_steps": 8}), monkeypatch, kill_after=4)
    resumed = _train(tiny_config(tmp_path / "split", train={**keys, "max_steps": 8}), monkeypatch)
    # a record's `threads` is the count after its step: the governor moved to 1 thread after step 4
    assert [r["threads"] for r in straight] == [2, 2, 2, 1, 1, 1, 1, 1]
    assert [r["threads"] for r in resumed] == [r["threads"] for r in straight]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in straight]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_records_the_governors_changes(tmp_path, monkeypatch):
    from meshlm.checkpoint.single import load_part, resolve_checkpoint
    from tests.conftest import tiny_config

    _train(tiny_config(tmp_path, train={"max_steps": 6, "adapt_threads": True}), monkeypatch)
    saved = load_part(resolve_checkpoint(tmp_path), "state")["threads"]
    assert saved == {"threads": 1, "history": [[0, 2], [4, 1]]}  # 1 thread from step 5 on


def test_deterministic_mode_turns_the_governor_off_and_a_resumed_run_keeps_the_count(tmp_path, monkeypatch):
    """train.deterministic: no governor (the busy host changes nothing), and a run resumed in a process whose
    torch has another thread count (here 1) continues with its checkpoint's (2), bit for bit."""
    from tests.conftest import tiny_config

    keys = {"log_every": 1, "deterministic": True}
    straight = _train(tiny_config(tmp_path / "straight", train={**keys, "max_steps": 6}), monkeypatch)
    tiny = tiny_config(tmp_path / "split", train={**keys, "max_steps": 6, "save_every": 3})
    _train(tiny, monkeypatch)
    for late in ("step_0000006", "latest"):  # killed after step 3's checkpoint: resumed from it
        shutil.rmtree(tmp_path / "split" / "checkpoints" / late, ignore_errors=True)
        (tmp_path / "split" / "checkpoints" / late).unlink(missing_ok=True)
    before = torch.get_num_threads()
    try:
        import json

        from meshlm.train.trainer import Trainer

        torch.set_num_threads(1)  # this process's own count differs from the checkpoint's
        Trainer(tiny_config(tmp_path / "split", train={**keys, "max_steps": 6})).run()
        resumed = [r for r in map(json.loads, (tmp_path / "split" / "metrics.jsonl").read_text().splitlines())
                   if r["kind"] == "train"]
    finally:
        torch.set_num_threads(before)
    assert [r["threads"] for r in straight] == [2] * 6 and [r["threads"] for r in resumed] == [2] * 6
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in straight]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)
