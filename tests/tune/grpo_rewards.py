"""Reward functions for tests/tune/test_grpo.py (loaded with `--reward tests.tune.grpo_rewards:NAME`)."""

from __future__ import annotations


def spaces(prompt: str, completion: str, row: dict) -> float:
    """The share of the completion's characters that are spaces: a random tiny model's top tokens differ in it."""
    return completion.count(" ") / max(1, len(completion))


def text(prompt: str, completion: str, row: dict):
    return "high"  # not a number


def boom(prompt: str, completion: str, row: dict) -> float:
    if completion:
        raise KeyError("answer")
    return 0.0
