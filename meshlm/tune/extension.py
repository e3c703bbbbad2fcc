"""A tune run inside the ordinary trainer: the `Tuning` extension (`train/extension.py`).

It gives the trainer the adapter as a model transform (`adapters.apply_adapters`: the adapter added to
this rank's part of the model, the base frozen) and keeps the run's checkpoints itself: at the start the
frozen base's weights (`tune.base`, every time), then the adapter's state from the checkpoint to resume
(`state.load`) or its first values (`adapters.init_virtual_tokens`), and one log line describing it; each
checkpoint holds the trainable tensors only (`state.save`).
"""

from __future__ import annotations

from pathlib import Path

from meshlm.core.config import Config
from meshlm.train.extension import Extension
from meshlm.tune import state
from meshlm.tune.adapters import apply_adapters, describe_adapter, init_virtual_tokens


class Tuning(Extension):
    """`tune.method` (prompt, ptuning, lora) on the frozen `tune.base`."""

    implements = ("tune.method",)
    owns_checkpoints = True
    transforms = (apply_adapters,)

    def restore(self, trainer, path: Path | None) -> None:
        trainer.init_from(trainer.cfg.tune.base)
        if path is not None:
            state.load(trainer, path)
            trainer.log(f"resumed from {path} at step {trainer.step}")
        else:
            init_virtual_tokens(trainer)
        trainer.log(describe_adapter(trainer))

    def save(self, trainer) -> Path:
        return state.save(trainer)


def tuning_extensions(cfg: Config) -> list[Extension]:
    """[Tuning()] when `cfg` tunes an adapter (tune.method is not none), else []."""
    return [Tuning()] if cfg.tune.method != "none" else []
