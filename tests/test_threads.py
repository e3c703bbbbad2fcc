"""meshlm's OpenMP wait policy for a shared CPU (docs/threads.md): opt-in (MESHLM_SHARED_CPU=1), set at start for
CPU runs, never over the user's choice."""

import os
from pathlib import Path

from meshlm import cli


def test_the_policy_is_opt_in_and_never_over_the_users_choice_or_on_a_gpu_host():
    shared = {"MESHLM_SHARED_CPU": "1"}
    assert cli.thread_policy(shared, nvidia_gpu=False) == {"GOMP_SPINCOUNT": "10000"}
    assert cli.thread_policy({}, nvidia_gpu=False) == {}
    assert cli.thread_policy({"MESHLM_SHARED_CPU": "0"}, nvidia_gpu=False) == {}
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000"), ("KMP_BLOCKTIME", "0")):
        assert cli.thread_policy({**shared, name: value}, nvidia_gpu=False) == {}, name
    assert cli.thread_policy(shared, nvidia_gpu=True) == {}


def test_main_sets_it_before_any_command_and_keeps_the_users_value(monkeypatch, capsys):
    for name in cli.THREAD_POLICY_VARIABLES:  # unset for the test; each restored afterwards (set or not)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MESHLM_SHARED_CPU", "1")
    assert cli.main(["train", "--train.max_steps=0"]) == 2  # a command that stops at its config
    gpu = Path("/proc/driver/nvidia/gpus").is_dir()
    assert os.environ.get("GOMP_SPINCOUNT") == (None if gpu else "10000")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli.main(["train", "--train.max_steps=0"]) == 2
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ
    assert "train.max_steps=0" in capsys.readouterr().err
