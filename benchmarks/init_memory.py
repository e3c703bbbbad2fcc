"""Host memory to build a model for a parallel layout: meta-device build vs the old whole-model build.

For each layout (tp=2, pp=2) a fresh world of 2 gloo processes builds `gpt2-1.3b` (or `--config`) and
reports every rank's peak resident set size (`ru_maxrss`) beside its baseline (after importing torch and
joining the process group, before building: the framework's fixed overhead). Two builds per layout:

* `whole`: the old way, `GPT(cfg)` whole from the seed on every rank, then `parallelize` slices it;
* `meta`: `parallel.build_model`: built on the meta device, cut, and only this rank's shards allocated
  and initialised (to the same values).

The criterion of issue #12: each rank's peak − baseline ≤ 60% of the whole fp32 model's bytes. Then,
without any process group, a 70B-parameter Llama shape at tp=8 × pp=8 is built on the meta device and cut
for its first rank (tp rank 0, pp rank 0): its shards' bytes are reported, nothing is allocated (the
process's RSS is measured before and after).

    .venv/bin/python benchmarks/init_memory.py [--config gpt2-1.3b] [--skip-whole]
    .venv/bin/python benchmarks/init_memory.py --smoke     # gpt-tiny's meta build at tp=2, then the 70B plan
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist

from meshlm.core.config import load_config
from meshlm.families.registry import get_spec

GiB = 2 ** 30


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(args, world: int) -> list[dict]:
    """One rank: build the model for the layout, return every rank's numbers (gathered)."""
    config, layout, how = args
    from meshlm.models.gpt import GPT
    from meshlm.parallel import ParallelDims, build_model, parallelize

    overrides = [f"--parallel.{'tp' if layout == 'tp2' else 'pp'}=2", "--train.global_batch_size=8",
                 "--train.micro_batch_size=4", "--train.recompute=none"]
    cfg = load_config(config, overrides)
    p = cfg.parallel
    dims = ParallelDims.build(tp=p.tp, pp=p.pp, dp=1, timeout_s=300, device=torch.device("cpu"))
    base = _peak()
    torch.manual_seed(0)
    if how == "whole":
        par = parallelize(GPT(cfg.model), dims, cfg, spec=get_spec(cfg.model.family))
    else:
        par = build_model(cfg, dims, spec=get_spec(cfg.model.family))
    local = sum(q.numel() * q.element_size() for q in par.model.parameters())
    row = {"rank": dims.rank, "base": base, "peak": _peak(), "local": local}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    return rows


def _plan_70b() -> dict:
    """A 70B Llama shape at tp=8 × pp=8, rank 0's shards on the meta device: bytes, no allocation."""
    from meshlm.core.config import build
    from meshlm.families.registry import get_spec
    from meshlm.parallel.mesh import ParallelDims
    from meshlm.parallel.pipeline import cut_stages
    from meshlm.parallel.tensor import apply_tensor_parallel

    model = {"n_layers": 80, "hidden_size": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn_hidden_size": 28672,
             "vocab_size": 32000, "seq_len": 4096, "position": "rope", "norm": "rmsnorm", "activation": "swiglu",
             "bias": False, "tie_embeddings": False}
    cfg = build({"model": model, "parallel": {"tp": 8, "pp": 8},
                 "train": {"micro_batch_size": 1, "global_batch_size": 64}})
    spec = get_spec("gpt")
    with torch.device("meta"):  # a first small build: every module imported and warmed up before measuring
        spec.model_class(build({"model": {"n_layers": 1, "hidden_size": 64, "n_heads": 8}}).model)
    before = _rss_now()
    with torch.device("meta"):
        plain = spec.model_class(cfg.model)
    total = sum(q.numel() for q in plain.parameters())
    dims = ParallelDims(pp=8, dp=1, tp=8, rank=0)  # planned: no process group, tp rank 0 and pp rank 0
    apply_tensor_parallel(plain, dims, sp=False, spec=spec)
    counts, _, _, _ = cut_stages(plain, spec, cfg, dims.pp_rank, fused=False)
    mine = list(plain.parameters())
    return {"params_total": total, "params_rank0": sum(q.numel() for q in mine),
            "bytes_rank0_fp32": sum(q.numel() * 4 for q in mine), "all_meta": all(q.is_meta for q in mine),
            "stage_layers": counts, "rss_growth": _rss_now() - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt2-1.3b")
    parser.add_argument("--skip-whole", action="store_true", help="only the meta-device builds")
    from smoke import add_smoke_flag, skipped

    add_smoke_flag(parser)
    args = parser.parse_args()
    from world import run_world

    layouts = ("tp2", "pp2")
    if args.smoke:
        args.config, args.skip_whole, layouts = "gpt-tiny", True, ("tp2",)
        skipped("the whole builds and the pp=2 layout (the 70B plan below cuts pipeline stages)")

    from meshlm.families.registry import get_spec

    cfg = load_config(args.config)
    whole = get_spec(cfg.model.family).parameter_count(cfg.model) * 4
    print(f"{args.config}: {whole / 4 / 1e9:.3f}B parameters, whole fp32 model {whole / GiB:.2f} GiB; "
          "2 gloo processes per build, peak RSS per rank (baseline: after torch + process group)")
    print("| layout | build | rank | baseline GiB | peak GiB | peak − baseline GiB | of whole model | "
          "local params GiB |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for layout in layouts:
        for how in (("meta",) if args.skip_whole else ("whole", "meta")):
            for r in run_world(2, _build, (args.config, layout, how), timeout_s=1800):
                grow = r["peak"] - r["base"]
                if how == "meta":
                    worst = max(worst, grow / whole)
                print(f"| {layout} | {how} | {r['rank']} | {r['base'] / GiB:.2f} | {r['peak'] / GiB:.2f} | "
                      f"{grow / GiB:.2f} | {100 * grow / whole:.0f}% | {r['local'] / GiB:.2f} |", flush=True)
    print(f"\nmeta builds: worst rank's peak − baseline = {100 * worst:.0f}% of the whole model "
          f"({'meets' if worst <= 0.6 else 'misses'} the ≤ 60% criterion)")
    plan = _plan_70b()
    print(f"\n70B Llama shape (80 × 8192, GQA 64/8, f 28672, V 32000) at tp=8 × pp=8, rank 0 on the meta device: "
          f"{plan['params_total'] / 1e9:.1f}B parameters in all; rank 0 holds {plan['params_rank0'] / 1e9:.3f}B "
          f"({plan['bytes_rank0_fp32'] / GiB:.2f} GiB in fp32; layers per stage {plan['stage_layers']}); "
          f"all meta: {plan['all_meta']}; RSS grew {plan['rss_growth'] / 2 ** 20:.1f} MiB")


if __name__ == "__main__":
    main()
