"""`meshlm align`: preference optimisation (DPO, IPO, SimPO) of a checkpoint on prompt / chosen / rejected
pairs (docs/align.md); the work is `meshlm.tune.align.run_align`'s."""

from __future__ import annotations

import argparse

METHODS = ("dpo", "ipo", "simpo")
ADAPTERS = ("none", "lora")


def _align(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.commands.train import trainer_extensions
    from meshlm.tune.align import run_align

    return run_align(args, overrides, trainer_extensions)


def add_align_command(sub) -> None:
    """Register `meshlm align` on the CLI's subparsers."""
    p = sub.add_parser("align", help="preference optimisation (DPO, IPO, SimPO) on prompt/chosen/rejected pairs",
                       description="DPO, IPO or SimPO of a checkpoint (or of a LoRA adapter on it) on .jsonl lines "
                                   "{\"prompt\", \"chosen\", \"rejected\"} (docs/align.md); extra "
                                   "--section.key=value override the config.")
    p.add_argument("--checkpoint", required=True, help="the base (and frozen reference): a run directory, a step dir "
                   "or a .gguf file")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--train", required=True, metavar="FILE.jsonl")
    p.add_argument("--valid", required=True, metavar="FILE.jsonl")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory (the same DIR again resumes)")
    p.add_argument("--beta", type=float, default=0.1, help="the preference strength β (default 0.1)")
    p.add_argument("--label-smoothing", type=float, default=0.0, metavar="EPS",
                   help="conservative DPO / SimPO: the share of pairs assumed flipped (default 0)")
    p.add_argument("--simpo-gamma", type=float, default=0.5, metavar="GAMMA",
                   help="SimPO's target reward margin γ (default 0.5, TRL's)")
    p.add_argument("--adapter", choices=ADAPTERS, default="none",
                   help="none: train every weight (default); lora: a LoRA adapter on the frozen base (tune.lora_*)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training pairs (default 1; "
                                                          "--train.max_steps overrides)")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="tokens per row, prompt + completion (default model.seq_len)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the Jinja2 chat template of conversational lines (default: the base tokenizer's, or "
                        "meshlm's builtin one)")
    p.set_defaults(func=_align)
