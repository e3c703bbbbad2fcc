"""`meshlm train`: a training run from a config (a bundled name or a .toml file) and --section.key=value
overrides; and the trainer of any config, with every extension it asks for (`build_trainer`), which the
tune and finetune commands and the tests use too."""

from __future__ import annotations

import argparse
import os
import sys
import time

from meshlm.core.config import DEFAULT_CONFIG, Config, ConfigError, bundled_configs


def trainer_extensions(cfg: Config) -> list:
    """The `train.extension.Extension`s `cfg` asks for: the adapter of `tune.method` (`meshlm.tune.extension`),
    then the evaluation tasks of `train.eval_tasks` (`meshlm.eval.during_training`), then the Hugging Face
    directories of `train.save_hf` (`meshlm.interop.during_training`); [] for none."""
    from meshlm.eval.during_training import eval_extensions
    from meshlm.interop.during_training import hf_extensions
    from meshlm.tune.extension import tuning_extensions

    return [*tuning_extensions(cfg), *eval_extensions(cfg), *hf_extensions(cfg)]


def build_trainer(cfg: Config, progress: bool | None = None, datasets: tuple | None = None,
                  started: float | None = None):
    """`train.trainer.Trainer(cfg, progress, datasets, started=started)` with `trainer_extensions(cfg)`: the
    trainer of `meshlm train` (tuning when tune.method is set, evaluation tasks when train.eval_tasks is)."""
    from meshlm.train.trainer import Trainer

    return Trainer(cfg, progress=progress, datasets=datasets, extensions=trainer_extensions(cfg), started=started)


def check_validation_split(cfg: Config) -> None:
    """A `data.split` without a validation share: refused where an evaluation every `train.eval_every` steps
    needs validation data, else one warning line (rank 0): the run reports no validation loss."""
    if cfg.data.split_weights[1] > 0:
        return
    if cfg.train.eval_every > 0:
        raise ConfigError(f"data.split={cfg.data.split!r} holds out no validation data, but train.eval_every="
                          f"{cfg.train.eval_every} evaluates on it; give a validation share (e.g. data.split='98,2,0') "
                          "or set train.eval_every=0")
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: data.split={cfg.data.split!r} holds out no validation data: this run reports no validation "
              "loss (the end evaluation is skipped); give a validation share, e.g. data.split='98,2,0'",
              file=sys.stderr, flush=True)


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    started = time.monotonic()  # train.time_budget_s counts from here: torch's import and the set-up included
    from meshlm.core.config import load_config
    from meshlm.parallel import destroy
    from meshlm.train.fit import check_training_fits

    cfg = load_config(args.config, overrides).check_paths()
    check_validation_split(cfg)
    check_training_fits(cfg)
    try:
        trainer = build_trainer(cfg, started=started)
        trainer.run()
    except BaseException:
        destroy()  # under torchrun: leave the process groups (a no-op for one process)
        raise
    destroy(wait_for_all=True)
    return trainer.exit_code  # 0, or 130 / 143 after SIGINT / SIGTERM (the checkpoint is saved)


def add_train_command(sub) -> None:
    """Register `meshlm train` on the CLI's subparsers."""
    train = sub.add_parser("train", help="train a model; extra --section.key=value override the config")
    train.add_argument("--config", default=DEFAULT_CONFIG,
                       help=f"bundled name ({', '.join(bundled_configs())}) or path to a .toml file")
    train.set_defaults(func=_train)
