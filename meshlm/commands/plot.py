"""`meshlm plot`: the loss curves of a run as a PNG."""

from __future__ import annotations

import argparse


def _plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.train.plot import plot_losses

    print(f"wrote {plot_losses(args.out_dir)}")
    return 0


def add_plot_command(sub) -> None:
    """Register `meshlm plot` on the CLI's subparsers."""
    plot = sub.add_parser("plot", help="write OUT_DIR/loss.png from OUT_DIR/metrics.jsonl")
    plot.add_argument("out_dir")
    plot.set_defaults(func=_plot)
