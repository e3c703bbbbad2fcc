"""The model families meshlm knows: `model.family` → its `ModelSpec` (`models/spec.py`).

A family is added by writing its plain model (`models/NAME.py`) and one spec, and registering the spec
here (built-in families) or from outside with `register` (a test's toy family, a user's plug-in).
"""

from __future__ import annotations

from torch import nn

from meshlm.config import ConfigError
from meshlm.models.spec import ModelSpec

_FAMILIES: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Make `spec` available as `model.family = spec.name` (registering the same name again replaces it)."""
    _FAMILIES[spec.name] = spec
    return spec


def _builtins() -> None:
    if "gpt" not in _FAMILIES:
        from meshlm.models.gpt import GPT_SPEC

        register(GPT_SPEC)
    if "bert" not in _FAMILIES:
        from meshlm.models.bert import BERT_SPEC

        register(BERT_SPEC)


def get_spec(family: str) -> ModelSpec:
    _builtins()
    if family not in _FAMILIES:
        raise ConfigError(f"model.family={family!r} is not a known model family; use one of {sorted(_FAMILIES)}")
    return _FAMILIES[family]


def families() -> list[str]:
    _builtins()
    return sorted(_FAMILIES)


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec of a plain model (by its class, or a subclass of a registered class)."""
    _builtins()
    for spec in _FAMILIES.values():
        if isinstance(model, spec.model_class):
            return spec
    raise TypeError(f"{type(model).__name__} belongs to no registered model family; register its ModelSpec")
