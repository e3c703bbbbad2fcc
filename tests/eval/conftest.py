"""A tiny GPT checkpoint and task files on it, shared by the evaluation tests of one session."""

from __future__ import annotations

import pytest

from tests.eval.eval_helpers import make_task_files, save_tiny_gpt


@pytest.fixture(scope="session")
def tiny_gpt(tmp_path_factory):
    return save_tiny_gpt(tmp_path_factory.mktemp("eval_gpt") / "run")


@pytest.fixture(scope="session")
def task_files(tiny_gpt, tmp_path_factory):
    """{kind: path} of a perplexity text, a cloze file and a choice file on which the tiny model scores
    above zero (the cloze passages end with the model's own greedy continuations)."""
    return make_task_files(tiny_gpt, tmp_path_factory.mktemp("eval_tasks"))
