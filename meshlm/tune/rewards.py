"""Rewards for `meshlm align --method grpo|rloo`: loading `--reward module:function`, calling them safely, and
the built-in verifiable ones.

A reward is a function `reward(prompt: str, completion: str, row: dict) -> float` (`row`: the prompt's JSONL
object, so it can hold the answer). Several are summed with `--reward-weights` (default 1 each).

Built-ins (`meshlm.tune.rewards:NAME`), each reading the row's `answer` and, optionally, `marker` (default
"####", the text after which the completion states its answer):
* `exact_number`: 1.0 when the first number after the last marker equals the answer (as numbers), else 0.0;
* `exact_string`: 1.0 when the text after the last marker, stripped, equals the answer, stripped;
* `format_regex`: 1.0 when the whole completion (stripped) matches the row's `format` regex, by default
  `FORMAT` (reasoning, then the marker and an answer on the last line).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from meshlm.core.config import ConfigError

MARKER = "####"
FORMAT = r"(?s).*\S.*\n\s*####\s*\S+"
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class Reward:
    name: str  # as given: "module:function"
    fn: Callable
    weight: float


def load_rewards(specs: list[str], weights: list[float] | None) -> list[Reward]:
    """The reward functions of `--reward module:function ...` with their `--reward-weights`; a ConfigError
    naming the flag when one does not import or is not a function."""
    if not specs:
        raise ConfigError("--reward is required for --method grpo|rloo: give module:function (e.g. "
                          "meshlm.tune.rewards:exact_number)")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"--reward-weights gives {len(weights)} weights for {len(specs)} --reward functions; give "
                          "one weight per reward")
    out = []
    for i, spec in enumerate(specs):
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(f"--reward {spec!r} is not module:function; e.g. meshlm.tune.rewards:exact_number")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001 -- any error importing the user's module is theirs to see
            raise ConfigError(f"--reward {spec!r}: module {module_name!r} does not import ({type(err).__name__}: "
                              f"{err}); check the module path and PYTHONPATH") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"--reward {spec!r}: {module_name} has no function {attr!r}")
        weight = 1.0 if weights is None else float(weights[i])
        if not math.isfinite(weight):
            raise ConfigError(f"--reward-weights {weights[i]} must be a finite number")
        out.append(Reward(spec, fn, weight))
    return out


class RewardError(ValueError):
    """A reward function failed on one completion (raised, or returned something that is not a number)."""


def call_reward(reward: Reward, prompt: str, completion: str, row: dict, where: str) -> float:
    """`reward`'s value for one completion as a float; a RewardError naming the reward and the row (`where`:
    file:line) when it raises or returns a non-number (text, None, NaN)."""
    try:
        value = reward.fn(prompt, completion, row)
    except Exception as err:  # noqa: BLE001 -- whatever the user's reward raises fails that row alone
        raise RewardError(f"reward {reward.name} raised {type(err).__name__}: {err} on {where}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise RewardError(f"reward {reward.name} returned {type(value).__name__} {shown} on {where}, not a finite "
                          "number")
    return float(value)


# ---- built-ins ----------------------------------------------------------------------------------------------
def _after_marker(completion: str, row: dict) -> str | None:
    marker = row.get("marker", MARKER)
    at = completion.rfind(marker)
    return None if at < 0 else completion[at + len(marker):]


def exact_number(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the first number after the last marker equals `row["answer"]` as numbers (commas ignored)."""
    tail = _after_marker(completion, row)
    found = NUMBER.search(tail) if tail is not None else None
    if found is None:
        return 0.0
    try:
        got, want = float(found.group().replace(",", "")), float(str(row["answer"]).replace(",", ""))
    except ValueError:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9) else 0.0


def exact_string(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the text after the last marker, stripped, equals `row["answer"]`, stripped."""
    tail = _after_marker(completion, row)
    return 1.0 if tail is not None and tail.strip() == str(row["answer"]).strip() else 0.0


def format_regex(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the stripped completion matches `row["format"]` (default `FORMAT`) in full."""
    return 1.0 if re.fullmatch(row.get("format", FORMAT), completion.strip()) else 0.0
