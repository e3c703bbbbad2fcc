"""`meshlm plan --trial K`: the top K layouts run for a few steps with torchrun on this machine, measured,
and re-ranked by their measured step time (docs/plan.md, "Trials")."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from meshlm.plan.options import PlanOptions


def trial_command(config: str, cand, world: int, steps: int, out_dir: str, overrides: list[str]) -> list[str]:
    """The command line that runs layout `cand` (a `plan.cost.Candidate`) for `steps` steps on this machine's
    CPUs, `world` processes under torchrun, writing its metrics to `out_dir`."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] \
        if world > 1 else [sys.executable]
    return [*launcher, "-m", "meshlm", "train", "--config", config, *overrides, *cand.overrides(),
            f"--train.max_steps={steps}", "--train.log_every=1", "--train.eval_every=0", "--train.eval_iters=1",
            "--train.save_every=0", "--train.sample_tokens=0", "--train.progress=false", "--train.device=cpu",
            "--train.peak_tflops=1.0", "--train.resume=never", f"--train.out_dir={out_dir}"]


def measured_step_time(out_dir: str, statistic: str = "median") -> float:
    """The median (or the minimum: the least disturbed by other work on a shared machine) step time of a
    run's metrics.jsonl, without its first step (warm-up)."""
    times = [json.loads(line)["step_time_s"] for line in Path(out_dir, "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line]
    times = sorted(times[1:] or times)
    return times[0] if statistic == "min" else times[len(times) // 2]


def run_trials(plan: PlanOptions, top: list, overrides: list[str]) -> list:
    """Run each layout with torchrun for --steps steps, measure, re-rank by measurement."""
    if plan.gpu.strip().lower() != "this":
        print(f"note: --trial runs on this machine, not on {plan.gpu}; the measured times are this machine's",
              file=sys.stderr)
    extra = [*overrides]
    if plan.seq_len is not None:
        extra.append(f"--model.seq_len={plan.seq_len}")
    if plan.global_batch_size is not None:
        extra.append(f"--train.global_batch_size={plan.global_batch_size}")
    for est in top:
        with tempfile.TemporaryDirectory(prefix="meshlm-plan-trial-") as tmp:
            cmd = trial_command(plan.config, est.candidate, est.candidate.world, plan.steps, tmp, extra)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(f"trial {est.candidate.label()} failed: {tail}", file=sys.stderr)
                est.measured_step_time_s = math.inf
                continue
            est.measured_step_time_s = measured_step_time(tmp)
    if not plan.json:
        print("trials (this machine): predicted vs measured step time\n")
        print("| layout | predicted s | measured s | measured / predicted |\n|---|---|---|---|")
        for est in top:
            m = est.measured_step_time_s
            print(f"| {est.candidate.label()} | {est.step_time_s:.4f} | {m:.4f} | {m / est.step_time_s:.2f} |")
        print()
    return sorted(top, key=lambda e: e.measured_step_time_s)
