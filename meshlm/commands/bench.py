"""`meshlm bench memory`: measured activation memory per layer beside the formula, and model states.

    meshlm bench memory --config llama-tiny --train.recompute=selective
    torchrun --nproc-per-node 2 -m meshlm bench memory --config gpt-tiny --parallel.tp=2 --parallel.sp=true
    torchrun --nproc-per-node 2 -m meshlm bench memory --config llama-tiny --parallel.cp=2

Under `parallel.cp` every cp rank measures its share of the rows; the report lists each rank beside the formula
at s/cp tokens and gives the ring's formulas (transient buffers, bytes sent per layer).

The measurement and its report are `plan/bench.py`'s `bench_memory`.
"""

from __future__ import annotations

import argparse

from meshlm.core.config import DEFAULT_CONFIG, bundled_configs


def _bench_memory(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.core.config import load_config
    from meshlm.parallel import destroy
    from meshlm.plan.bench import bench_memory
    from meshlm.train.fit import check_bench_fits

    cfg = load_config(args.config, overrides)
    check_bench_fits(cfg)
    try:
        text = bench_memory(cfg)
    except BaseException:
        destroy()
        raise
    destroy(wait_for_all=True)
    if text:
        print(text)
    return 0


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """Register `bench` (with its one kind, `memory`) on the CLI's subparsers."""
    bench = sub.add_parser("bench", help="measurements of this build (meshlm bench memory)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    memory = kinds.add_parser("memory", help="activation bytes saved for backward per layer, measured and by "
                                             "formula; extra --section.key=value override the config")
    memory.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"bundled name ({', '.join(bundled_configs())}) or path to a .toml file")
    memory.set_defaults(func=_bench_memory)
