"""The demo model's training step alone and with one busy process beside it, under several thread settings.

    python benchmarks/busy_step.py [--steps 10] [--warmup 3] [--settings default,passive,...] [--batch 16]
    python benchmarks/busy_step.py --smoke     # the default setting, one step of one row of a 1-layer demo model
                                               # (its busy process sleeps: the numbers mean nothing)

On a small CPU a training step uses every core through OpenMP; when another process holds one of them,
OpenMP's threads that wait for each other (libgomp spins 300,000 iterations before it sleeps) burn their
time slices waiting for the thread that was descheduled, and a step can take many times longer than the
share of the CPU the other process takes would explain. This measures it: each setting runs in a fresh
subprocess (the OpenMP environment is read when torch loads), which builds the demo run (`configs/demo.toml`,
meshlm's real `Trainer.train_step`), takes `--warmup` untimed steps and times `--steps` more, first with
the machine as it is, then with one busy process beside it (a pure-Python loop, one core's worth). The
table gives the median seconds per step of both and their ratio, and both against the `default` setting's step
alone (the quiet machine's speed); the target is a step beside the busy process no slower than the busy
process's share of the CPU explains (about 2× the default alone on 2 cores) without a slower step alone.
`adaptive` is meshlm's default (`train.adapt_threads`, meshlm/train/threads.py): its child calls the trainer's
thread governor after each step as the training loop does, and the table's next line gives the thread count
after each step (warm-up included: the governor needs two 2-second windows to decide).

Each child starts with a clean OpenMP environment (OMP_*, GOMP_*, KMP_* removed) plus its setting's
variables, so meshlm's own choice at start (`meshlm/cli.py`, docs/threads.md) applies only where a setting
says `meshlm`. Run it on an otherwise idle machine: the "alone" column is only alone then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smoke import SMOKE_HELP  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
SMOKE_MODEL = ["--model.n_layers=1", "--model.hidden_size=64", "--model.seq_len=64"]

# name: (environment, torch threads or 0 for torch's default, what it is)
SETTINGS = {
    "default": ({}, 0, "torch's defaults (spinning OpenMP threads, one per core)"),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 0, "waiting threads sleep at once"),
    "spin0": ({"GOMP_SPINCOUNT": "0"}, 0, "libgomp: no spinning (like passive)"),
    "spin1k": ({"GOMP_SPINCOUNT": "1000"}, 0, "libgomp: spin 1k iterations, then sleep"),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, 0, "libgomp: spin 10k iterations, then sleep"),
    "spin100k": ({"GOMP_SPINCOUNT": "100000"}, 0, "libgomp: spin 100k iterations, then sleep"),
    "1thread": ({}, 1, "one thread (torch.set_num_threads(1))"),
    "1thread-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 1, "one thread, passive"),
    "meshlm": ({"MESHLM_BENCH_USE_CLI_POLICY": "1"}, 0, "what meshlm sets at start (meshlm/cli.py)"),
    "adaptive": ({}, 0, "train.adapt_threads (meshlm's default): threads follow the CPUs left free"),
}
ADAPTIVE = {"adaptive"}  # settings whose child calls the trainer's thread governor after each step, as its loop does

BUSY = "while True:\n    pass\n"  # one core's worth of pure Python, no threads
# --smoke's busy process: started and killed around the child as BUSY is, but asleep. A smoke run's numbers mean
# nothing, and BUSY would spin on a core for the whole child (its torch import and trainer set-up included),
# taking that core from whatever else runs beside the smoke test.
SMOKE_BUSY = "import time\nwhile True:\n    time.sleep(60)\n"


def clean_env() -> dict[str, str]:
    """This environment without the OpenMP settings a user may have set."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}


def child(args: argparse.Namespace) -> None:
    """One measurement, in a fresh process: seconds of each timed step, as JSON on the last line."""
    if os.environ.pop("MESHLM_BENCH_USE_CLI_POLICY", None):
        from meshlm.cli import set_thread_policy

        set_thread_policy()
    import torch

    from meshlm.core.config import load_config
    from meshlm.train.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("demo", [f"--train.out_dir={out}", "--train.progress=false", "--train.log_every=1000",
                                   f"--train.micro_batch_size={args.batch}", f"--train.global_batch_size={args.batch}",
                                   f"--train.adapt_threads={str(args.adapt).lower()}",
                                   *(SMOKE_MODEL if args.smoke else [])])
        trainer = Trainer(cfg, progress=False)
        times, counts = [], []
        for i in range(args.warmup + args.steps):
            began = time.perf_counter()
            trainer.train_step()
            if i >= args.warmup:
                times.append(time.perf_counter() - began)
            if trainer.threads is not None:  # what Trainer._loop does after every step
                trainer.threads.after_step()
            counts.append(torch.get_num_threads())
    print(json.dumps({"times": times, "threads": torch.get_num_threads(), "counts": counts,
                      "policy": os.environ.get("OMP_WAIT_POLICY", ""), "spin": os.environ.get("GOMP_SPINCOUNT", "")}))


def measure(name: str, args: argparse.Namespace, busy: bool) -> dict:
    env_vars, threads, _ = SETTINGS[name]
    env = {**clean_env(), **env_vars}
    cmd = [sys.executable, __file__, "--child", f"--steps={args.steps}", f"--warmup={args.warmup}",
           f"--threads={threads}", f"--batch={args.batch}"] + (["--adapt"] if name in ADAPTIVE else []) + \
        (["--smoke"] if args.smoke else [])
    hog = subprocess.Popen([sys.executable, "-c", SMOKE_BUSY if args.smoke else BUSY]) if busy else None
    try:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if result.returncode != 0:
        raise SystemExit(f"{name} ({'busy' if busy else 'alone'}) failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="rows of 256 tokens a step (the demo's: 16)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"any of {', '.join(SETTINGS)}")
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--adapt", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke and not args.child:
        args.settings, args.steps, args.warmup, args.batch = "default", 1, 0, 1
    if args.child:
        child(args)
        return
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; pick from {', '.join(SETTINGS)}")
    shape = f"a 1-layer, 64-wide demo model, batch {args.batch} × 64" if args.smoke else \
        f"demo model, batch {args.batch} × 256"
    print(f"{os.cpu_count()} CPUs; {shape}, {args.warmup} warm-up + {args.steps} timed "
          f"steps per measurement; busy: one pure-Python loop{' (smoke: asleep)' if args.smoke else ''}")
    print(f"{'setting':<16} {'threads':>7} {'alone s/step':>12} {'busy s/step':>11} {'slowdown':>8} "
          f"{'vs default alone':>16}  what")
    reference = None  # the default setting's step alone: the quiet machine's speed every setting is held to
    for name in names:
        alone, busy = measure(name, args, busy=False), measure(name, args, busy=True)
        a, b = statistics.median(alone["times"]), statistics.median(busy["times"])
        reference = a if name == "default" else reference
        against = f"{a / reference:.2f} / {b / reference:.2f}" if reference else "-"
        threads = f"{alone['threads']}/{busy['threads']}"  # alone / busy, at the end of the run
        print(f"{name:<16} {threads:>7} {a:>12.3f} {b:>11.3f} {b / a:>7.2f}x {against:>16}  {SETTINGS[name][2]}",
              flush=True)
        if name in ADAPTIVE:
            print(f"{'':<16} thread counts after each step, alone: {alone['counts']}; busy: {busy['counts']}")


if __name__ == "__main__":
    main()
