"""The model families meshlm knows: `model.family` → its `ModelSpec` (`families/spec.py`).

A family is added by writing its plain model (`models/NAME.py`) and one spec, and registering the spec
here (built-in families) or from outside with `register` (a test's toy family, a user's plug-in).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from torch import nn

from meshlm.core.config import ConfigError
from meshlm.families.spec import ModelSpec
from meshlm.models.init import meta_device
from meshlm.models.params import param_groups

_FAMILIES: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Make `spec` available as `model.family = spec.name` (registering the same name again replaces it)."""
    _FAMILIES[spec.name] = spec
    return spec


def _builtins() -> None:
    if "gpt" not in _FAMILIES:
        from meshlm.families.gpt import GPT_SPEC

        register(GPT_SPEC)
    if "bert" not in _FAMILIES:
        from meshlm.families.bert import BERT_SPEC

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


def muon_share(cfg) -> float:
    """The share of the model's parameters that `optim.name=muon` steps with Muon (the hidden layers'
    matrices, one fp32 momentum buffer each instead of Adam's two): the first group of
    `models.params.param_groups`, counted on the meta device. 0 for any other optimizer (or no config)."""
    if cfg is None or cfg.optim.name != "muon":
        return 0.0
    return _hidden_matrix_share(cfg.model)


@lru_cache(maxsize=64)
def _hidden_matrix_share(m) -> float:
    """Muon's share for `m`, from one- and two-layer meta models (both counts are linear in the layers, so
    a model of any depth costs the same)."""
    counts = []
    for n_layers in (1, 2):
        with meta_device():
            model = get_spec(m.family).model_class(dataclasses.replace(m, n_layers=n_layers))
        groups = param_groups(model, 0.0, muon=True)
        sizes = [sum(p.numel() for p in g["params"]) for g in groups]
        counts.append((sizes[0], sum(sizes)))
    (h1, t1), (h2, t2) = counts
    hidden = h1 + (m.n_layers - 1) * (h2 - h1)
    total = t1 + (m.n_layers - 1) * (t2 - t1)
    return hidden / total if total else 0.0
