"""The config of the tiny run behind the reliability tests' `run` and `copy` fixtures (conftest.py)."""

from __future__ import annotations

from tests.conftest import tiny_config


def small(out, **train):
    return tiny_config(out, train={"max_steps": 2, "save_every": 1, "sample_tokens": 0, **train})
