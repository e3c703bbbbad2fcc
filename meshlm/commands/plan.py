"""`meshlm plan`: the layout for a model on a cluster, for training (ranked, explained, tried) or serving.

    meshlm plan --config gpt2-1.3b --gpus 16 --gpus-per-node 8 --gpu a100-80gb --global-batch-size 512
    meshlm plan --config gpt2-1.3b --gpus 16 --gpu a100-80gb --explain tp=2,pp=1,dp=8,mbs=4
    meshlm plan --config gpt2-1.3b --gpus 16 --gpu a100-80gb --layout tp=2,pp=2   # the rest completed to fit
    meshlm plan --config gpt-tiny --gpus 2 --gpu this --trial 3 --steps 6
    meshlm plan --config gpt2-1.3b --gpu h100-80gb --inference --tpot-ms 20

The planner runs in `plan/report.py` (`run_plan`); docs/plan.md describes the cost model.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from meshlm.core.config import DEFAULT_CONFIG, ConfigError, bundled_configs

if TYPE_CHECKING:
    from meshlm.plan.options import PlanOptions

# The `--gpu-NAME` options: each overrides one field of the GPU (`plan.catalog.OVERRIDABLE`, in its order;
# memory-gb is the field memory_gib).
GPU_FIELDS = [("tflops", "dense 16-bit peak TFLOP/s"), ("memory-gb", "memory per GPU, GiB"),
              ("hbm-gbps", "memory bandwidth, GB/s"), ("intra-gbps", "intra-node link per GPU, GB/s"),
              ("inter-gbps", "inter-node link per GPU, GB/s"), ("intra-latency-us", "intra-node latency, µs"),
              ("inter-latency-us", "inter-node latency, µs"), ("op-overhead-us", "host time per op, µs"),
              ("gather-cost", "all-gather / reduce-scatter cost as a fraction of an all-reduce's")]

# The runtimes --runtime describes (`plan.cost.RUNTIMES`, in its order): meshlm's own, Megatron-LM as the
# published measurements ran it (docs/plan.md, "What runs"), or DeepSeek-V3's (FP8, DualPipe; docs/formulas.md).
RUNTIMES = ("meshlm", "megatron-2021", "megatron-2022", "deepseek-v3")


def _check_cluster(args: argparse.Namespace) -> None:
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be >= 1")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node} must be >= 1")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        below = args.gpus // args.gpus_per_node * args.gpus_per_node
        raise ConfigError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node}: whole nodes "
                          f"only; use --gpus {below} or {below + args.gpus_per_node}")
    for name, value in (("--top", args.top), ("--steps", args.steps), ("--prompt-tokens", args.prompt_tokens),
                        ("--output-tokens", args.output_tokens)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be >= 1")
    if args.trial < 0:
        raise ConfigError(f"--trial {args.trial} must be >= 0")


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The typed options of `meshlm plan`'s parsed flags (what `meshlm.plan.report.run_plan` takes)."""
    from meshlm.plan.options import PlanOptions

    return PlanOptions(config=args.config, gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                       gpu_tflops=args.gpu_tflops, gpu_memory_gb=args.gpu_memory_gb, gpu_hbm_gbps=args.gpu_hbm_gbps,
                       gpu_intra_gbps=args.gpu_intra_gbps, gpu_inter_gbps=args.gpu_inter_gbps,
                       gpu_intra_latency_us=args.gpu_intra_latency_us, gpu_inter_latency_us=args.gpu_inter_latency_us,
                       gpu_op_overhead_us=args.gpu_op_overhead_us, gpu_gather_cost=args.gpu_gather_cost,
                       global_batch_size=args.global_batch_size, seq_len=args.seq_len, precision=args.precision,
                       runtime=args.runtime, top=args.top, all=args.all, json=args.json, layout=args.layout,
                       explain=args.explain, write_config=args.write_config, trial=args.trial, steps=args.steps,
                       inference=args.inference, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                       ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    _check_cluster(args)
    from meshlm.plan.report import run_plan

    return run_plan(plan_options(args), overrides)


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    """Register `plan` on the CLI's subparsers."""
    plan = sub.add_parser("plan", help="choose the parallel layout for a model on a cluster (training or "
                                       "serving); extra --section.key=value override the config")
    plan.add_argument("--config", default=DEFAULT_CONFIG,
                      help=f"bundled name ({', '.join(bundled_configs())}) or path to a .toml file")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs in the cluster (training)")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--gpu", default="a100-80gb", help="catalog name, or 'this' to measure this machine")
    for name, text in GPU_FIELDS:
        plan.add_argument(f"--gpu-{name}", type=float, default=None, help=f"override the GPU's {text}")
    plan.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default: the config's)")
    plan.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the config's)")
    plan.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                      help="default: bf16 on a catalog GPU, the config's on --gpu this")
    plan.add_argument("--runtime", choices=RUNTIMES, default="meshlm",
                      help="the software whose costs are modelled: meshlm (default), Megatron-LM as the papers "
                           "ran it (16-bit weights with fp32 master copies, stored attention scores, no DP overlap), "
                           "or DeepSeek-V3's (FP8 GEMMs, DualPipe, node-limited all-to-all)")
    plan.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    plan.add_argument("--all", action="store_true", help="every fitting variant, not the best of each layout")
    plan.add_argument("--json", action="store_true", help="print the ranked layouts as a JSON list")
    plan.add_argument("--layout", default=None, help="one layout, any of tp=8,pp=8,dp=16,cp=1,vpp=1,sp=true,mbs=1,"
                                                      "recompute=selective|full|full:N|none,zero=1; the search "
                                                      "completes the fields left out with the fastest that fit")
    plan.add_argument("--explain", default=None, metavar="LAYOUT", help="print every memory and time term of a layout")
    plan.add_argument("--write-config", default=None, metavar="PATH", help="write the winning layout's config (.toml)")
    plan.add_argument("--trial", type=int, default=0, metavar="K", help="run the top K layouts with torchrun here")
    plan.add_argument("--steps", type=int, default=6, help="steps per trial (the first is not timed)")
    plan.add_argument("--inference", action="store_true", help="plan serving: tp and batch size")
    plan.add_argument("--prompt-tokens", type=int, default=512)
    plan.add_argument("--output-tokens", type=int, default=128)
    plan.add_argument("--ttft-ms", type=float, default=None, help="target time to first token")
    plan.add_argument("--tpot-ms", type=float, default=None, help="target time per output token")
    plan.set_defaults(func=_plan)
