"""What the benchmark scripts share for their `--smoke` runs (a helper module, not a script).

Every script in benchmarks/ takes `--smoke`: its smallest run (a tiny model, one or two steps, a few requests,
no outside servers such as vLLM), which checks that the script still runs end to end and prints its table;
tests/test_benchmarks_smoke.py runs each one that way. The numbers of a smoke run mean nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SMOKE_HELP = ("the smallest run (a tiny model, 1-2 steps, a few requests, no outside servers): checks that the "
              "script runs and prints its table; the numbers mean nothing (tests/test_benchmarks_smoke.py)")


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def skipped(what: str) -> None:
    """Say what a smoke run leaves out, so its output does not pass for a full run's."""
    print(f"smoke: skipped {what}", flush=True)


def tiny_checkpoint(out: str | Path, config: str = "gpt-tiny", **model) -> Path:
    """`config`'s model at the shape `model` overrides (e.g. n_layers=1, hidden_size=32), randomly initialised
    from seed 0 and saved as a run directory at step 1 (its weights and config, as `meshlm train` saves them):
    a base for the scripts that read a trained run, whose smoke runs have none."""
    import torch

    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.core.config import load_config
    from meshlm.families.registry import get_spec

    cfg = load_config(config, [f"--model.{k}={v}" for k, v in model.items()] + [f"--train.out_dir={out}"])
    torch.manual_seed(0)
    net = get_spec(cfg.model.family).model_class(cfg.model)
    save_checkpoint(out, 1, {"model": net.state_dict()}, cfg.to_dict())
    return Path(out)
