"""Running the ordinary `Trainer` on datasets a command prepared (finetune, tune, align): the schedule that
follows from the data, the run directory's info file, and the run itself with nothing half-way on failure.

The commands give the trainer's extensions (`train/extension.py`) as a function of the run's config
(`Extensions`), so this module never imports the layers above it."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from meshlm.core.config import Config, ConfigError, build
from meshlm.core.console import is_main

if TYPE_CHECKING:
    from meshlm.train.extension import Extension

# A config → the trainer's extensions for it (`train/extension.py`), given by the command.
Extensions = Callable[[Config], "list[Extension]"]


def override_keys(overrides: list[str]) -> set[str]:
    """The `section.key` names a list of `--section.key=value` overrides sets."""
    return {o.removeprefix("--").split("=", 1)[0] for o in overrides}

def with_schedule(values: dict, overrides: list[str], n_train: int, n_valid: int, epochs: int):
    """The config with the keys that follow from the data and the batch size, unless the user set them:
    `epochs` passes over the `n_train` examples (train.max_steps), a warmup of 10% of the steps, an evaluation
    of all `n_valid` (a multiple of the micro-batch) validation rows and a checkpoint after each epoch."""
    t, user = build(values).train, override_keys(overrides)
    per_epoch = max(1, math.ceil(n_train / t.global_batch_size))
    max_steps = t.max_steps if "train.max_steps" in user else epochs * per_epoch
    derived = {
        "train.max_steps": max_steps,
        "train.eval_every": per_epoch,
        "train.save_every": per_epoch,
        "train.log_every": max(1, min(50, per_epoch // 5)),
        "train.eval_iters": max(1, n_valid // t.micro_batch_size),
        "optim.warmup_steps": max(1, max_steps // 10),
    }
    values = {k: dict(v) for k, v in values.items()}
    for key, value in derived.items():
        if key not in user:
            section, name = key.split(".")
            values[section][name] = value
    return build(values)

def write_info(out: Path, info: dict, name: str, keep: tuple[str, ...]) -> None:
    """DIR/`name` (atomically); a run directory holding another run (one of `keep` differs) is refused."""
    path = out / name
    if path.exists():
        old = json.loads(path.read_text())
        for key in keep:
            if old.get(key) != info[key]:
                raise ConfigError(f"{out} holds another run ({key}={old.get(key)!r}, not {info[key]!r}); use another "
                                  "--out to start a new run")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    tmp.replace(path)

def train_prepared(cfg, datasets: tuple, out_dir: str, write, extensions: Extensions) -> tuple[object, dict]:
    """Run the Trainer on datasets a command prepared: DIR made and `write(DIR)` (its info file) on rank 0
    first; a run that cannot start leaves no new DIR. `extensions(cfg)`: the trainer's extensions for the
    run's config (`train/extension.py`; `meshlm.commands.train.trainer_extensions`). Returns (trainer, its
    result)."""
    from meshlm.parallel import destroy
    from meshlm.train import trainer as trainer_module
    from meshlm.train.fit import check_training_fits

    # activations at the rows' width (`.T` tokens per example), not model.seq_len: a released model's context
    # (SmolLM2's 8,192) would refuse a tuning run whose rows are a few hundred tokens
    width = min(getattr(datasets[1], "T", cfg.model.seq_len), cfg.model.seq_len)
    check_training_fits(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_len=width)))
    out = Path(out_dir)
    created = not out.exists()
    try:
        if is_main():
            out.mkdir(parents=True, exist_ok=True)
            write(out)
        trainer = trainer_module.Trainer(cfg, datasets=datasets, extensions=extensions(cfg))
    except BaseException:
        if created and is_main():  # nothing half-way: a run that could not start leaves no DIR
            shutil.rmtree(out, ignore_errors=True)
        destroy()
        raise
    try:
        result = trainer.run()
    except BaseException:
        destroy()
        raise
    destroy(wait_for_all=True)
    return trainer, result

