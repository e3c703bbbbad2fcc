"""`meshlm finetune`: a BERT checkpoint fine-tuned on a labelled task (docs/finetune.md); the work is
`meshlm.train.finetune.run_finetune`'s."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlm.train.finetune import FinetuneOptions

TASKS = ("classify", "span", "tokens")
DEFAULT_EPOCHS = 3


def finetune_options(args: argparse.Namespace) -> FinetuneOptions:
    """The typed options of `meshlm finetune`'s parsed flags (what `meshlm.train.finetune` takes)."""
    from meshlm.train.finetune import FinetuneOptions

    return FinetuneOptions(checkpoint=args.checkpoint, task=args.task, train=args.train, valid=args.valid,
                           out=args.out, epochs=args.epochs, max_length=args.max_length, truncate=args.truncate)


def _finetune(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.commands.train import trainer_extensions
    from meshlm.train.finetune import run_finetune

    return run_finetune(finetune_options(args), overrides, trainer_extensions)


def add_finetune_command(sub) -> None:
    """Register `meshlm finetune` on the CLI's subparsers."""
    p = sub.add_parser("finetune", help="fine-tune a BERT checkpoint on a classify, span or tokens task",
                       description="Fine-tune a BERT checkpoint on labelled .jsonl data (docs/finetune.md); "
                                   "extra --section.key=value override the config.")
    p.add_argument("--checkpoint", required=True, help="the base run directory (its latest checkpoint) or a step dir")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--train", required=True, metavar="FILE.jsonl")
    p.add_argument("--valid", required=True, metavar="FILE.jsonl")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory (the same DIR again resumes)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                   help=f"passes over the training set (default {DEFAULT_EPOCHS}; --train.max_steps overrides)")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="tokens per example, padding included (default model.seq_len; shorter runs faster)")
    p.add_argument("--truncate", action="store_true",
                   help="cut examples longer than model.seq_len instead of refusing them")
    p.set_defaults(func=_finetune)
