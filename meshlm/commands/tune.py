"""`meshlm tune`: an adapter (prompt tuning, p-tuning, LoRA) trained on a frozen checkpoint, or the whole
model fine-tuned on the same data (docs/tune.md), input/output lines or conversations (chat SFT); the work
is `meshlm.tune.command.run_tune`'s."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from meshlm.commands.finetune import DEFAULT_EPOCHS, TASKS

if TYPE_CHECKING:
    from meshlm.tune.command import TuneOptions

METHODS = ("prompt", "ptuning", "lora", "full")  # full: every weight trains (supervised fine-tuning, SFT), no adapter


def tune_options(args: argparse.Namespace) -> TuneOptions:
    """The typed options of `meshlm tune`'s parsed flags (what `meshlm.tune.command` takes)."""
    from meshlm.tune.command import TuneOptions

    return TuneOptions(checkpoint=args.checkpoint, method=args.method, train=args.train, valid=args.valid,
                       out=args.out, epochs=args.epochs, template=tuple(args.template or ()), task=args.task,
                       max_length=args.max_length, truncate=args.truncate, chat_template=args.chat_template,
                       pack=args.pack)


def _tune(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.commands.train import trainer_extensions
    from meshlm.tune.command import run_tune

    return run_tune(tune_options(args), overrides, trainer_extensions)


def add_tune_command(sub) -> None:
    """Register `meshlm tune` on the CLI's subparsers."""
    p = sub.add_parser("tune", help="train an adapter (prompt tuning, p-tuning, LoRA) on a frozen checkpoint, or "
                                    "fine-tune it whole (--method full: SFT)",
                       description="Prompt tuning, p-tuning or LoRA of a frozen checkpoint, or full fine-tuning (SFT), "
                                   "on .jsonl data: input/output lines or conversations ({\"messages\": [...]}, the "
                                   "loss on the assistant's turns) (docs/tune.md); extra --section.key=value override "
                                   "the config.")
    p.add_argument("--checkpoint", required=True, help="the frozen base: a run directory (its latest checkpoint), a .gguf file or "
                                                       "a step dir")
    p.add_argument("--method", required=True, choices=METHODS,
                   help="full: every weight trains (SFT, no adapter); prompt, ptuning, lora: an adapter on the frozen base")
    p.add_argument("--train", required=True, metavar="FILE.jsonl")
    p.add_argument("--valid", required=True, metavar="FILE.jsonl")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory (the same DIR again resumes)")
    p.add_argument("--template", action="append", metavar="[TASK=]TEXT",
                   help="a prompt template ending in {answer}, per task; lines then hold taskname, fields and answer")
    p.add_argument("--task", choices=TASKS, default=None, help="BERT checkpoints: the task of meshlm finetune")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                   help=f"passes over the training set (default {DEFAULT_EPOCHS}; --train.max_steps overrides)")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="tokens per example row (default model.seq_len)")
    p.add_argument("--truncate", action="store_true",
                   help="cut the start of inputs too long for a row (conversations: keep their start)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="conversations ('messages' lines): the chat template (Jinja) to render them with, instead of "
                        "the checkpoint's")
    p.add_argument("--pack", action="store_true",
                   help="conversations: several per row, each attending only to itself (data.document_mask=true)")
    p.set_defaults(func=_tune)
