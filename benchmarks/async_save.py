"""How long a checkpoint stalls training: a synchronous save against `train.async_save`, one run each.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/async_save.py [--steps 15 --save-every 5 --seq 128 --out DIR]
    .venv/bin/python benchmarks/async_save.py --smoke      # gpt-tiny's config at a tiny width, 4 steps

The model is `configs/gpt2-124m.toml`'s shape (12 layers, h = 768, 12 heads, GPT-2's 50,257-token vocabulary,
tied head) trained in fp32 on this CPU with one row of `--seq` tokens a step (the shape sets the checkpoint's
size, ~1.5 GB of weights and AdamW moments; the sequence length only the step's time and the position table).
The same run goes twice through the real `Trainer` loop, saving every `--save-every` steps: synchronously,
then with `train.async_save=true`. Each step, each save call and each step-boundary poll is timed from the
outside (the Trainer's methods wrapped here).

Stall of a save: the time the training thread spends on it. Synchronous: the time inside the save call
(the training thread writes the files). In the background: the time inside the save call (the host copy
and the hand-over) plus any time the training thread later waited for the write (at the poll that
published it, at the next save, at the end of the run: one write at a time). Shown beside it, not in the
stall: how much longer the steps that ran during the write took than a normal step (the median of the
other steps after the first): the worker shares the CPU, but on a machine shared with other jobs this
difference is mostly their noise. The table gives each save, the worker's write time, and the ratio of
the mean stalls (target: async <= 10% of sync). The defaults leave 5 steps after each save, so that a write
(15-30 s for 1.5 GB here while the steps run beside it) normally ends before the next save or the end of the
run; with writes longer than `--save-every` steps the waits count in the stall.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

from meshlm.checkpoint.background import SingleJob
from meshlm.core.config import load_config
from meshlm.train.trainer import Trainer


def _timed(log: list, kind: str, method):
    def wrapper(self, *args, **kwargs):
        in_flight = self._writer is not None and self._writer.job is not None
        began = time.perf_counter()
        out = method(self, *args, **kwargs)
        log.append({"kind": kind, "step": self.step, "s": time.perf_counter() - began, "in_flight": in_flight,
                    "background": kwargs.get("background", False), "waiting": kwargs.get("waiting", False)})
        return out
    return wrapper


def run(out: Path, async_save: bool, args) -> list[dict]:
    """One training run; the timed events (steps, saves, polls) in order."""
    cfg = load_config(args.config, [
        f"--train.out_dir={out}", f"--train.max_steps={args.steps}", f"--train.save_every={args.save_every}",
        "--train.micro_batch_size=1", "--train.global_batch_size=1", f"--model.seq_len={args.seq}",
        "--train.precision=fp32", "--train.device=cpu", "--train.eval_iters=1", "--train.log_every=1",
        "--train.peak_tflops=1", "--train.progress=false", "--train.sample_tokens=0", "--train.keep_last=0",
        "--train.adapt_threads=false", f"--train.async_save={str(async_save).lower()}", "--train.resume=never",
        *args.model])
    log: list[dict] = []
    real = {name: getattr(Trainer, name) for name in ("train_step", "save", "poll_save", "_complete_save")}
    write = SingleJob.write

    def timed_write(job):
        began = time.perf_counter()
        write(job)
        log.append({"kind": "write", "step": job.step, "s": time.perf_counter() - began})
    try:
        for name, method in real.items():
            setattr(Trainer, name, _timed(log, name, method))
        SingleJob.write = timed_write
        Trainer(cfg).run()
    finally:
        for name, method in real.items():
            setattr(Trainer, name, method)
        SingleJob.write = write
    return log


def stalls(log: list[dict]) -> tuple[float, list[dict]]:
    """(normal step seconds, one row per in-loop save: step, seconds in the save call, extra seconds of the
    steps that overlapped its write, seconds in the poll that published it or waiting for it at the next
    save (the final one included), total stall)."""
    steps = [e for e in log if e["kind"] == "train_step"]
    normal = statistics.median(e["s"] for e in steps[1:] if not e["in_flight"])
    rows, current, waited = [], None, 0.0
    writes = {e["step"]: e["s"] for e in log if e["kind"] == "write"}
    for e in log:
        if e["kind"] == "write":
            continue
        if e["kind"] == "_complete_save" and e["waiting"] and e["in_flight"] and current is not None:
            current["wait_s"] += e["s"]  # inside the next save call: the previous save's stall
            waited = e["s"]
        elif e["kind"] == "save" and e["background"]:
            current = {"step": e["step"], "save_s": e["s"] - waited, "overlap_s": 0.0, "wait_s": 0.0,
                       "write_s": writes.get(e["step"], e["s"] - waited)}
            rows.append(current)
        elif current is not None and e["kind"] == "train_step" and e["in_flight"]:
            current["overlap_s"] += e["s"] - normal
        elif current is not None and e["kind"] == "poll_save" and e["in_flight"]:
            current["wait_s"] += e["s"]
        if e["kind"] != "_complete_save":
            waited = 0.0
    for row in rows:
        row["stall_s"] = row["save_s"] + row["wait_s"]
    return normal, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt2-124m", help="the model shape (a config name)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default=None, help="a directory on the disk to measure (default: a temporary one)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.model = []
    if args.smoke:
        args.config, args.steps, args.save_every, args.seq = "gpt-tiny", 4, 2, 16
        args.model = ["--model.n_layers=1", "--model.hidden_size=32", "--model.n_heads=2"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.config} shape, seq {args.seq}, fp32, "
          f"{args.steps} steps, a save every {args.save_every}")
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        results = {mode: stalls(run(Path(tmp) / mode, mode == "async", args)) for mode in ("sync", "async")}
    print("\n| mode | save at step | write s | in save call s | waited later s | stall s | normal step s | "
          "steps during the write vs normal s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, (normal, rows) in results.items():
        for r in rows:
            print(f"| {mode} | {r['step']} | {r['write_s']:.2f} | {r['save_s']:.3f} | {r['wait_s']:.3f} | "
                  f"{r['stall_s']:.3f} | {normal:.2f} | {r['overlap_s']:+.2f} |")
    for label, first in (("all saves", 0), ("after the first (buffers reused)", 1)):
        if any(len(rows) <= first for _, rows in results.values()):
            continue  # a single save: nothing after the first
        mean = {mode: statistics.mean(r["stall_s"] for r in rows[first:]) for mode, (_, rows) in results.items()}
        ratio = mean["async"] / mean["sync"]
        print(f"mean stall, {label}: sync {mean['sync']:.3f} s, async {mean['async']:.3f} s; async / sync = "
              f"{ratio:.1%} ({'within' if ratio <= 0.10 else 'over'} the 10% target)")


if __name__ == "__main__":
    main()
