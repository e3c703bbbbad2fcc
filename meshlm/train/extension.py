"""What the trainer is given instead of importing it: `Extension`s.

The trainer runs pretraining and fine-tuning on its own. Three features of a run sit above `train` in the
layers and reach the loop as objects passed to `Trainer(cfg, ..., extensions=[...])`:

* `meshlm tune`'s adapters (`tune.method`): `meshlm.tune.extension.tuning_extensions(cfg)`;
* evaluation tasks at each evaluation (`train.eval_tasks`): `meshlm.eval.during_training.eval_extensions(cfg)`;
* Hugging Face directories from the published checkpoints (`train.save_hf`):
  `meshlm.interop.during_training.hf_extensions(cfg)`.

Code that may import them all (the commands, tests) assembles them: `meshlm.commands.train.build_trainer(cfg)`
is the trainer of `meshlm train` for any config. A `Trainer` given a config that sets one of
`EXTENSION_KEYS` without an extension that `implements` it refuses to start (rather than silently
pretrain a tune run, or skip its evaluation tasks).

An extension overrides what it needs of this class; every hook runs on every rank, in the order given:

* `transforms`: `parallel.Transform`s that `parallel.build_model` applies to this rank's materialised
  part of the model, before the pipeline schedule, recomputation and data parallelism (adapters, the
  base frozen);
* `owns_checkpoints`: it keeps the run's checkpoints instead of the trainer (one extension at most):
  `restore(trainer, path)` is called once the trainer is built (model, optimizer, data loader) with the
  checkpoint to resume (None: a fresh run), instead of the trainer's own resume and `train.init_from`;
  `save(trainer)` publishes each checkpoint (a collective) and returns its path;
* `evaluate(trainer)`: more metrics at each evaluation, merged into the evaluation's record (metrics.jsonl,
  TensorBoard's valid/ scalars and the log line);
* `adapt_spec(spec)`: the model family's `ModelSpec` this run uses, before anything is built from it (`meshlm
  align`: the preference loss as the spec's `loss_for`, which the trainer, tensor parallelism and the last
  pipeline stage all compute the loss with);
* `published(trainer, path)`: checkpoint `path` is published (its manifest in place), after a synchronous or
  an asynchronous save; called on every rank, on the main thread.

What an extension may use of the trainer: `cfg`, `spec`, `dims`, `device`, `model`, `parallel`,
`optimizer`, `sync`, `loader`, `precision`, `tokenizer`, `tp_rng`, `out_dir`, `n_params`, `step`,
`tokens_seen`, `skipped_steps`, and the methods `log`, `init_from`, `run_state`, `layout_summary`,
`restore_position`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from meshlm.core.config import Config
from meshlm.parallel import Transform

# Config keys whose feature only an extension provides: key → whether `cfg` asks for it.
EXTENSION_KEYS = {"tune.method": lambda cfg: cfg.tune.method != "none",
                  "train.eval_tasks": lambda cfg: bool(cfg.train.eval_tasks),
                  "train.save_hf": lambda cfg: bool(cfg.train.save_hf)}


class Extension:
    """A part of a training run given to the `Trainer` (see the module doc); the defaults do nothing."""

    implements: ClassVar[tuple[str, ...]] = ()  # the `EXTENSION_KEYS` this extension provides
    owns_checkpoints: ClassVar[bool] = False
    transforms: Sequence[Transform] = ()

    def restore(self, trainer, path: Path | None) -> None:
        """The run's starting state (`owns_checkpoints`): from checkpoint `path`, or fresh when None."""
        raise NotImplementedError

    def save(self, trainer) -> Path:
        """Publish this step's checkpoint (`owns_checkpoints`; a collective); returns its path."""
        raise NotImplementedError

    def evaluate(self, trainer) -> dict:
        """Metrics to add to this evaluation's record (every rank calls it)."""
        return {}

    def adapt_spec(self, spec):
        """The family spec the run uses instead of `spec` (default: `spec` itself)."""
        return spec

    def published(self, trainer, path: Path) -> None:
        """Checkpoint `path` is published (its manifest in place, sync or async save): called on every rank,
        on the main thread."""


def check_extensions(cfg: Config, extensions: Sequence[Extension]) -> Extension | None:
    """The extension that owns the checkpoints (None: the trainer does); ValueError when `cfg` sets a
    key of `EXTENSION_KEYS` that no extension implements, or several extensions own the checkpoints."""
    given = {key for e in extensions for key in e.implements}
    for key, asked in EXTENSION_KEYS.items():
        if asked(cfg) and key not in given:
            raise ValueError(f"{key} is set but no extension given to the Trainer implements it; build the "
                             "trainer with meshlm.commands.train.build_trainer(cfg)")
    owners = [e for e in extensions if e.owns_checkpoints]
    if len(owners) > 1:
        raise ValueError(f"{len(owners)} extensions own the checkpoints ({', '.join(type(e).__name__ for e in owners)});"
                         " give one")
    return owners[0] if owners else None
