#!/usr/bin/env python3
"""A mixture of experts against the dense model of equal ACTIVE parameters, trained for the same wall time on
the bundled corpus; and expert parallelism's speed (ep 2 against ep 1, two processes).

    .venv/bin/python benchmarks/moe_vs_dense.py [--seconds 300] [--ep-steps 30] [--work runs/moe-vs-dense]
                                                [--skip-quality] [--skip-ep]
    .venv/bin/python benchmarks/moe_vs_dense.py --smoke    # a 1-layer gpt-moe-tiny: 2 steps, then ep 2 for 2
                                                           # steps; scored on a slice of the held-out works

1. **quality at equal wall time** (both with the `SHAPE` overrides below: the corpus's 4,096-token vocabulary,
   8 rows a step): `meshlm train --config llama-tiny` (4 layers × 128, SwiGLU 384 wide) and
   `meshlm train --config gpt-moe-tiny` (the same decoder, each MLP replaced by 8 SwiGLU experts 192 wide,
   top 2: 2 × 192 = 384 active, as the dense MLP; + a 8 × 128 router per layer), each alone with
   `train.time_budget_s=--seconds` (the whole command, set-up included; the run fits its step count and
   learning-rate schedule to it, WSD so that the count follows the clock until the decay starts), no
   evaluation during training, no sample. Both are then scored by one
   evaluator (`demo_quality.bits_per_byte`): the held-out works of the corpus (meshlm's validation split, whole
   works) in bits per byte, windows of 128 tokens at a stride of 64. Tokens/s: the median of the run's
   logged `tokens_per_s` (metrics.jsonl), the first log step left out (warm-up).
2. **expert parallelism**: `torchrun --nproc_per_node 2 -m meshlm train --config gpt-moe-tiny` for
   `--ep-steps` steps with `parallel.ep=1` (data parallel: each rank holds all 8 experts) and `parallel.ep=2`
   (each rank 4 experts, tokens exchanged all-to-all), the same global batch (4 rows a rank); the median
   logged tokens/s of both (gloo on CPU: a CPU measures the all-to-all's cost, not a GPU's speed-up).

Prints the commands it runs, then a markdown table. Run it on an otherwise idle machine: the wall-time budget
makes the quality rows depend on the CPU the runs get.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from smoke import add_smoke_flag, skipped  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

COMMON = ["--train.sample_tokens=0", "--train.progress=false", "--train.resume=never", "--train.eval_every=0",
          "--train.log_every=10"]
# Both configs trained with the corpus's own 4,096-token vocabulary (as the demo, configs/demo.toml) and 8 rows of
# 128 tokens a step: with GPT-2's 50,257 rows the output layer is most of a tiny model's work, and a 2-core CPU
# takes ~10 s a step at 16 rows, too few steps in minutes to tell the models apart.
SHAPE = ["--data.tokenizer=shakespeare-bpe:4096", "--model.vocab_size=4096", "--train.micro_batch_size=8",
         "--train.global_batch_size=8"]
# --smoke: a 1-layer, 32-wide model, 2 steps by count (no time budget), every step logged
SMOKE_MODEL = ["--model.n_layers=1", "--model.hidden_size=32", "--model.n_heads=2", "--model.n_kv_heads=1",
               "--model.moe_expert_hidden=16", "--model.seq_len=32", "--train.log_every=1"]
SMOKE_QUALITY = [*SMOKE_MODEL, "--train.time_budget_s=0", "--train.max_steps=2", "--train.micro_batch_size=2",
                 "--train.global_batch_size=2"]
SMOKE_EP = [*SMOKE_MODEL, "--train.micro_batch_size=1", "--train.global_batch_size=2"]


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.perf_counter() - t0


def _metrics(out: Path) -> dict:
    """Median tokens/s (the first log step left out), steps and the last training loss of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "tokens_per_s" in r]
    speeds = [r["tokens_per_s"] for r in train[1:]] or [r["tokens_per_s"] for r in train]
    return {"tokens_per_s": statistics.median(speeds) if speeds else float("nan"),
            "steps": max((r.get("step", 0) for r in train), default=0),
            "loss": train[-1].get("loss", float("nan")) if train else float("nan")}


def _params(config: str, extra: list[str] = ()) -> tuple[int, int]:
    """(all parameters, active parameters per token) of a config's model: the top-k experts of each MoE layer."""
    import torch

    from meshlm.core.config import load_config
    from meshlm.models.gpt import GPT

    m = load_config(config, [*SHAPE, *extra]).model
    with torch.device("meta"):
        model = GPT(m)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * m.moe_top_k // max(m.moe_experts, 1)
    return total, active


def quality(config: str, seconds: float, work: Path, held_out: list[str], extra: list[str] = ()) -> dict:
    from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script
    from demo_quality import bits_per_byte

    out = work / config
    # WSD (warmup, constant, linear decay over the last 20%): the budget revises the step count from the
    # measured step time until the decay starts (train/budget.py), so a change in the machine's load early in
    # the run does not fix a wrong count; cosine would fix it after the warmup.
    cmd = [sys.executable, "-m", "meshlm", "train", "--config", config, f"--train.out_dir={out}",
           f"--train.time_budget_s={seconds:g}", "--train.max_steps=100000", "--optim.decay=wsd", *COMMON, *SHAPE,
           *extra]
    code, wall = _run(cmd, work / f"{config}.log", seconds * 3 + 300)
    if code:
        return {"error": f"exit {code}; see {work / f'{config}.log'}"}
    model, tok, cfg = load_run(str(out))
    bpb = bits_per_byte(lambda x: model.eval()(x), tok, held_out, cfg.model.seq_len)
    total, active = _params(config, extra)
    return {**_metrics(out), "wall": wall, "bpb": bpb, "total": total, "active": active}


def expert_parallel(ep: int, steps: int, work: Path, extra: list[str] = ()) -> dict:
    out = work / f"ep{ep}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "meshlm",
           "train", "--config", "gpt-moe-tiny", f"--train.out_dir={out}", f"--train.max_steps={steps}",
           f"--parallel.ep={ep}", "--parallel.timeout_s=120", *COMMON, *SHAPE, "--train.micro_batch_size=4", *extra]
    code, wall = _run(cmd, work / f"ep{ep}.log", 1800)
    if code:
        tail = (work / f"ep{ep}.log").read_text().strip().splitlines()[-1:] or [""]
        return {"error": f"exit {code}: {tail[0][:200]}"}
    return {**_metrics(out), "wall": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300, help="wall time of each quality run (default 300)")
    ap.add_argument("--ep-steps", type=int, default=30)
    ap.add_argument("--work", default="runs/moe-vs-dense")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-ep", action="store_true")
    ap.add_argument("--only", default="llama-tiny,gpt-moe-tiny", help="the quality rows to run (comma-separated)")
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        import tempfile

        skipped("llama-tiny's quality run and ep 1 (gpt-moe-tiny alone, then ep 2)")
        args.only, args.ep_steps = "gpt-moe-tiny", 2
        with tempfile.TemporaryDirectory() as tmp:
            args.work = tmp
            return run(args, (2,), SMOKE_QUALITY, SMOKE_EP)
    return run(args)


def run(args: argparse.Namespace, eps: tuple = (1, 2), quality_extra: list[str] = (), ep_extra: list[str] = ()) -> int:
    """The quality runs of `args.only` and the expert-parallel runs at each of `eps`, then the tables;
    `*_extra`: config overrides added to their commands (--smoke's)."""
    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    rows, ep_rows = {}, {}
    if not args.skip_quality:
        from demo_quality import corpus_split

        from meshlm.core.config import load_config

        _, held_out = corpus_split(load_config("llama-tiny", SHAPE))
        if args.smoke:
            held_out = [text[:2000] for text in held_out]
        for config in args.only.split(","):
            rows[config] = quality(config, args.seconds, work, held_out, quality_extra)
            print(f"{config}: {rows[config]}", flush=True)
    if not args.skip_ep:
        for ep in eps:
            ep_rows[ep] = expert_parallel(ep, args.ep_steps, work, ep_extra)
            print(f"ep {ep}: {ep_rows[ep]}", flush=True)
    if rows:
        print(f"\n| model (budget {args.seconds:g} s each, alone) | parameters (active) | wall | steps | tokens/s | "
              "held-out bits/byte |\n|---|---|---|---|---|---|")
        for name, r in rows.items():
            if "error" in r:
                print(f"| {name} | - | - | - | - | {r['error']} |")
            else:
                print(f"| {name} | {r['total'] / 1e6:.2f} M ({r['active'] / 1e6:.2f} M) | {r['wall']:.0f} s | {r['steps']} | "
                      f"{r['tokens_per_s']:,.0f} | {r['bpb']:.3f} |")
    if ep_rows:
        print(f"\n| gpt-moe-tiny, 2 processes (gloo), {args.ep_steps} steps | tokens/s | wall |\n|---|---|---|")
        for ep, r in ep_rows.items():
            name = f"ep {ep}" + (" (dp 2, all experts on each rank)" if ep == 1 else " (4 experts per rank)")
            print(f"| {name} | {r['error']} | - |" if "error" in r else
                  f"| {name} | {r['tokens_per_s']:,.0f} | {r['wall']:.0f} s |")
        if len(ep_rows) == 2 and all("error" not in r for r in ep_rows.values()):
            print(f"\nep 2 / ep 1 tokens/s: {ep_rows[2]['tokens_per_s'] / ep_rows[1]['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
