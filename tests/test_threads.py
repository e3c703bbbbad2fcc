"""meshlm's OpenMP wait policy (docs/threads.md): set at start for CPU runs, never over the user's choice."""

import os
from pathlib import Path

from meshlm import cli


def test_the_policy_is_passive_unless_the_user_chose_or_a_gpu_is_present():
    assert cli.thread_policy({}, nvidia_gpu=False) == {"GOMP_SPINCOUNT": "10000"}
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000"), ("KMP_BLOCKTIME", "0")):
        assert cli.thread_policy({name: value}, nvidia_gpu=False) == {}, name
    assert cli.thread_policy({}, nvidia_gpu=True) == {}


def test_main_sets_it_before_any_command_and_keeps_the_users_value(monkeypatch, capsys):
    for name in cli.THREAD_POLICY_VARIABLES:  # unset for the test; each restored afterwards (set or not)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert cli.main(["train", "--train.max_steps=0"]) == 2  # a command that stops at its config
    gpu = Path("/proc/driver/nvidia/gpus").is_dir()
    assert os.environ.get("GOMP_SPINCOUNT") == (None if gpu else "10000")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli.main(["train", "--train.max_steps=0"]) == 2
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ
    assert "train.max_steps=0" in capsys.readouterr().err
