"""Fixtures of the reliability tests: `run`, a tiny run with two one-process checkpoints (steps 1 and 2) trained
once per test module, and `copy`, a hard-linked copy of it for each test to damage."""

from __future__ import annotations

import os
import shutil

import pytest

from meshlm.train.trainer import Trainer
from tests.reliability.trained_run import small


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    Trainer(small(out)).run()
    return out


@pytest.fixture
def copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out, copy_function=os.link)
    return out
