"""Predicted against measured step times of small layouts on this machine (CPU, gloo), and their rank
correlation.

    python benchmarks/plan_trials.py                 # 10 layouts of a small GPT on 2 and 4 processes
    python benchmarks/plan_trials.py --model demo    # the same layouts of the demo's Llama-style model
    python benchmarks/plan_trials.py --steps 8 --json trials.json
    python benchmarks/plan_trials.py --smoke         # one 1-process layout of a 1-layer gpt-tiny, 2 steps; the
                                                     # machine measured without its gloo links and busy cores

Two small models: `gpt-tiny` (4 layers, hidden 128, GPT-2's 50,257-token vocabulary: its LM head and loss
are about 85% of a step, so the ranking mostly tests how the head is priced under each layout) and `demo`
(4 layers of the demo's Llama-style block, hidden 256, sequence 256, its 4,096-token vocabulary: the layers
are most of the step, as in a real model; fp32 and AdamW, the precision and optimizer the model prices).

The planner's "GPU" is this machine, measured here first: the one-thread matmul rate, the memory bandwidth
and the per-op host time (`catalog.measure_this(threads=1)`: torchrun gives each process one thread), and
gloo's all-reduce latency and bandwidth between 2 processes, fitted to all-reduces of 4 B to 8 MiB run
between matmuls as a training step runs them, and its all-gathers' and reduce-scatters' cost against
those all-reduces' (`catalog.measure_links`, as `meshlm plan --gpu this` does). n
busy processes on c cores each get min(1, c/n) of a core (`catalog.share_cores`, `cost.estimate`). Each layout then runs
`meshlm train` under torchrun for --steps steps; its measured step time is the minimum of the logged step
times without the first (the least disturbed by other jobs on a shared machine; --statistic median), over
--rounds runs of every layout taken in turn. The Spearman rank correlation of predicted and measured times is printed (the
planner's ranking is what matters; the acceptance bar is 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from smoke import add_smoke_flag, skipped  # benchmarks/smoke.py, beside this script

from meshlm.core.config import load_config
from meshlm.plan.catalog import measure_links, measure_this, share_cores, with_overrides
from meshlm.plan.cost import Candidate, Cluster, Options
from meshlm.plan.search import evaluate
from meshlm.plan.trials import measured_step_time, trial_command

MODELS = {  # name: (bundled config, overrides)
    "gpt-tiny": ("gpt-tiny", ["--model.n_layers=4", "--model.seq_len=128", "--train.global_batch_size=16",
                              "--train.precision=fp32"]),
    "demo": ("demo", ["--model.n_layers=4", "--train.global_batch_size=16", "--train.precision=fp32",
                      "--optim.name=adamw"]),
}
LAYOUTS = [  # (tp, pp, dp, vpp, sp, micro-batch, recompute, zero)
    Candidate(1, 1, 2, micro_batch_size=8),
    Candidate(1, 1, 2, micro_batch_size=1),
    Candidate(1, 1, 2, micro_batch_size=8, recompute="full"),
    Candidate(2, 1, 1, micro_batch_size=8),
    Candidate(2, 1, 1, sp=True, micro_batch_size=4, recompute="selective"),
    Candidate(1, 2, 1, micro_batch_size=2),
    Candidate(1, 2, 1, micro_batch_size=8),
    Candidate(1, 1, 4, micro_batch_size=4, zero=1),
    Candidate(2, 1, 2, micro_batch_size=2),
    Candidate(2, 2, 1, micro_batch_size=4),
]
SMOKE_MODEL = ["--model.n_layers=1", "--model.hidden_size=32", "--model.n_heads=2", "--model.seq_len=32"]
SMOKE_LAYOUTS = [Candidate(1, 1, 1, micro_batch_size=8)]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's on the ranks (ties get their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="run every layout this many times, in turn")
    parser.add_argument("--statistic", choices=("min", "median"), default="min",
                        help="of the timed steps: min (the least disturbed by other jobs) or median")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    add_smoke_flag(parser)
    args = parser.parse_args()
    config, overrides = MODELS[args.model]
    layouts = LAYOUTS
    if args.smoke:
        overrides, layouts, args.steps, args.rounds = overrides + SMOKE_MODEL, SMOKE_LAYOUTS, 2, 1
    cfg = load_config(config, overrides)
    cores = os.cpu_count() or 1
    one = measure_this(threads=1, cores=1 if args.smoke else cores)
    if args.smoke:
        skipped("measuring gloo's links and the busy-core slowdown (the catalog's defaults stand in)")
        gbps, latency, gather = one.intra_gbps, one.intra_latency_us, one.gather_cost
    else:
        gbps, latency, gather = measure_links()
    one = with_overrides(one, intra_gbps=gbps, inter_gbps=gbps, intra_latency_us=latency, inter_latency_us=latency,
                         gather_cost=gather)
    gpu = share_cores(one, cores)
    print(f"this machine ({cores} cores), one thread: {one.tflops * 1e3:.1f} GFLOP/s fp32 matmul (GEMM curve "
          f"{one.gemm_max_efficiency:.2f}·w/(w + {one.gemm_half_width:.0f})), "
          f"{one.hbm_gbps:.1f} GB/s copy, {one.op_overhead_us:.1f} µs per op, softmax {one.softmax_ns_per_element:.1f} "
          f"ns per logit (fused head {one.fused_softmax_ns_per_element:.1f}), {one.busy_slowdown:.2f}x slower on "
          f"all {cores} cores at once; gloo {gbps:.2f} GB/s, {latency:.0f} µs, all-gather / reduce-scatter "
          f"{gather:.2f}× an all-reduce; load average {os.getloadavg()[0]:.2f}")
    opts = Options(precision="fp32", device_type="cpu", fused_loss=cfg.train.fused_loss)
    rows = []
    for cand in layouts:
        est = evaluate(cfg, cand, Cluster(gpu, cand.world, cand.world), cfg.train.global_batch_size, opts)
        rows.append({"layout": cand.label(), "world": cand.world, "predicted_s": est.step_time_s, "runs": []})
    for round_ in range(args.rounds):  # rounds go through every layout in turn: a busy spell hits all alike
        for cand, row in zip(layouts, rows):
            with tempfile.TemporaryDirectory(prefix="meshlm-trial-") as tmp:
                cmd = trial_command(config, cand, cand.world, args.steps, tmp, overrides)
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode:
                    print(f"{cand.label()}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                    return 1
                row["runs"].append(measured_step_time(tmp, args.statistic))
            print(f"  round {round_ + 1}: {cand.label()}: predicted {row['predicted_s']:.4f} s, measured "
                  f"{row['runs'][-1]:.4f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    for row in rows:  # the least disturbed round, or the median one
        runs = sorted(row["runs"])
        row["measured_s"] = runs[0] if args.statistic == "min" else runs[len(runs) // 2]
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    print(f"\nmeshlm plan trials: {config} {' '.join(overrides)}, {args.steps} steps × {args.rounds} round(s) each ({args.statistic}), on {cores} cores "
          f"(load average after: {os.getloadavg()[0]:.2f})\n")
    print("| layout | processes | predicted s | measured s | measured / predicted |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['world']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | "
              f"{r['measured_s'] / r['predicted_s']:.2f} |")
    print(f"\nSpearman rank correlation (predicted vs measured): {rho:.3f} over {len(rows)} layouts "
          f"({'meets' if rho >= 0.8 else 'BELOW'} the 0.8 bar)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "spearman": rho}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
