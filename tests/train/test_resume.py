"""Checkpoints: exact resume, crash safety, clean stop on signals."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from meshlm.checkpoint.files import load_config_dict, prune_temporaries, step_name
from meshlm.checkpoint.single import latest_checkpoint, load_part, resolve_checkpoint
from meshlm.train.trainer import Trainer
from tests.conftest import ROOT, tiny_config


def train_losses(out_dir) -> list[tuple[int, float]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


def test_resume_is_exact_in_fp32(tmp_path):
    n = 3
    straight = tmp_path / "straight"
    Trainer(tiny_config(straight, train={"max_steps": 2 * n}, model={"dropout": 0.1})).run()
    split = tmp_path / "split"
    Trainer(tiny_config(split, train={"max_steps": n}, model={"dropout": 0.1})).run()
    resumed = Trainer(tiny_config(split, train={"max_steps": 2 * n, "resume": "auto"}, model={"dropout": 0.1}))
    assert resumed.step == n
    resumed.run()
    a, b = train_losses(straight), train_losses(split)
    assert [s for s, _ in a] == list(range(1, 2 * n + 1))
    assert a == b  # bit-identical: same data position, RNG, optimizer and schedule state
    final_a = load_part(resolve_checkpoint(straight), "model")
    final_b = load_part(resolve_checkpoint(split), "model")
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key


def test_resume_never_starts_fresh_and_explicit_path_resumes(tmp_path):
    Trainer(tiny_config(tmp_path / "a", train={"max_steps": 2})).run()
    fresh = Trainer(tiny_config(tmp_path / "a", train={"max_steps": 4, "resume": "never"}))
    assert fresh.step == 0
    explicit = Trainer(tiny_config(tmp_path / "b", train={"max_steps": 4, "resume": str(tmp_path / "a")}))
    assert explicit.step == 2


def test_checkpoint_holds_everything_needed(tmp_path):
    Trainer(tiny_config(tmp_path, train={"max_steps": 2})).run()
    path = resolve_checkpoint(tmp_path)
    assert path.name == "step_0000002"
    state = load_part(path, "state")
    assert {"step", "rng", "loader", "tokens_seen", "tokenizer"} <= set(state)
    assert state["loader"]["consumed"] == 2 * 4
    assert load_config_dict(path)["train"]["max_steps"] == 2
    assert "state" in load_part(path, "optim")


KILLER = textwrap.dedent("""
    import sys, time
    from meshlm.checkpoint import single
    out = sys.argv[1]
    single.save_checkpoint(out, 1, {"model": {"w": list(range(10))}}, {"step": 1})
    real = single.save_torch  # looked up in single.py, where save_checkpoint calls it
    def slow(obj, path):            # a slow disk: the process is killed in the middle of step 2's write
        entry = real(obj, path)
        print("writing", flush=True)
        time.sleep(60)
        return entry
    single.save_torch = slow
    single.save_checkpoint(out, 2, {"model": {"w": [0]}, "optim": {}}, {"step": 2})
""")


def test_sigkill_during_checkpoint_write_keeps_previous_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    leftovers = list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert leftovers, "the kill should have interrupted a write in progress"
    latest = resolve_checkpoint(tmp_path)
    assert latest.name == "step_0000001"
    assert load_part(latest, "model") == {"w": list(range(10))}
    prune_temporaries(tmp_path)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_sigkill_of_real_training_at_random_moments_never_corrupts(tmp_path):
    """Kill a real run saving every step at several moments; `latest` always loads and resumes."""
    for delay in (0.0, 0.35, 0.8):
        proc = subprocess.Popen([sys.executable, "-m", "meshlm", "train", "--config", "gpt-tiny",
                                 *tiny_overrides(tmp_path, max_steps=10_000, save_every=1)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:  # wait until it is training (and so saving every step)
            if line.startswith("step"):
                break
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        latest = latest_checkpoint(tmp_path)
        if latest is None:  # killed before the first save finished: allowed only on the first run
            assert delay == 0.0
            continue
        state = load_part(latest, "state")
        load_part(latest, "model")
        load_part(latest, "optim")
        assert latest.name == step_name(state["step"])
    assert latest_checkpoint(tmp_path) is not None


def tiny_overrides(out_dir, max_steps: int, save_every: int = 0) -> list[str]:
    return ["--model.n_layers=2", "--model.hidden_size=32", "--model.n_heads=4", "--model.seq_len=32",
            "--train.micro_batch_size=2", "--train.global_batch_size=2", f"--train.max_steps={max_steps}",
            f"--train.save_every={save_every}", f"--train.out_dir={out_dir}", "--train.log_every=1",
            "--train.progress=false", "--train.peak_tflops=1", "--train.sample_tokens=0"]


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "meshlm", "train", "--config", "gpt-tiny",
                             *tiny_overrides(tmp_path, max_steps=100_000)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("step"):
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, "a stopped run is not a finished one"
    assert "stopped by SIGTERM" in rest
    state = load_part(resolve_checkpoint(tmp_path), "state")
    assert 1 <= state["step"] < 100_000
